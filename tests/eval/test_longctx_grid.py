"""tools/measure/longctx_grid.py: every piece writes its own JSON (so each resumes alone), and a peer
reads prompts that an earlier piece exports, at the same length."""

import pytest

from tool_scripts import load_tool


@pytest.fixture(scope="module")
def grid():
    return load_tool("measure/longctx_grid.py")


def flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("pieces", ["PIECES", "DEV_PIECES", "PEAK_PIECES", "QA_PIECES"])
def test_pieces_have_unique_names_and_their_own_json(grid, pieces):
    pieces = getattr(grid, pieces)
    names = [name for name, _, _ in pieces]
    assert len(names) == len(set(names))
    for name, runner, argv in pieces:
        assert runner in grid.RUNNERS
        written = flag(argv, "--export-prompts") if "prompts-" in name else flag(argv, "--json")
        assert written == f"{name}.json"


def test_peak_pieces_read_one_prompt_a_process_beside_full_at_each_length(grid):
    peaks = [(name, argv) for name, _, argv in grid.PEAK_PIECES]
    assert not {name for name, _, _ in grid.PIECES} & {name for name, _ in peaks}
    assert peaks and all("--fresh-process" in argv and flag(argv, "--batch") == "1" for _, argv in peaks)
    lengths = {flag(argv, "--contexts") for _, argv in peaks}
    for length in lengths:  # every recipe's peak has full's beside it, on the same prompts
        here = [argv for _, argv in peaks if flag(argv, "--contexts") == length]
        assert {flag(argv, "--tasks") for argv in here} == {grid.MEMORY_FAMILIES}
        assert sum(flag(argv, "--policies") == "full" for argv in here) == 1 and len(here) == 1 + len(grid.RECIPES)


@pytest.mark.parametrize("pieces", ["PIECES", "QA_PIECES"])
def test_each_peer_reads_an_export_made_before_it_at_its_length(grid, pieces):
    exported = []
    for name, runner, argv in getattr(grid, pieces):
        if "prompts-" in name:
            exported.append(flag(argv, "--export-prompts"))
            assert flag(argv, "--split") == "test"
        elif runner != "h2okv":
            assert argv[0] in exported, f"{name} reads {argv[0]} before any piece exports it"
            assert argv[0].split("-")[-1] == f"{name.rsplit('-', 1)[-1]}.json"
        elif "--split" in argv:
            assert flag(argv, "--split") == "test"  # the grid reports; it never runs dev prompts
        else:  # a fresh split (the protocol's rule 4): the test half's texts, another haystack than dev's
            assert int(flag(argv, "--seed")) % 2 == 1 and flag(argv, "--haystack") != "essays"


def test_qa_pieces_ask_four_questions_a_document_of_the_same_prompts(grid):
    """Every QA piece of ours at one length reads the same documents (tasks, samples, four
    questions), and the peers read the export of exactly those; at 8k, full and two recipes each read
    them once, nothing else."""
    ours = [argv for name, runner, argv in grid.QA_PIECES if runner == "h2okv"]
    for length in ("2048", "8192"):
        here = [a for a in ours if flag(a, "--contexts") == length]
        assert len({(flag(a, "--tasks"), flag(a, "--samples"), flag(a, "--questions-per-context")) for a in here}) == 1
    long = [a for a in ours if flag(a, "--contexts") == "8192"]
    assert len(long) == 3 and all(flag(a, "--question") == "agnostic" for a in long)
    assert all(flag(a, "--questions-per-context") == "4" and flag(a, "--tasks") == grid.QA_TASKS for a in ours)
    assert {flag(a, "--policies") for a in ours if "--export-prompts" not in a} == {"full", "none", "h2o"}


def test_unknown_piece_is_a_one_line_error(grid, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["longctx_grid.py", "--only", "nope", "--list"])
    with pytest.raises(SystemExit) as exit_:
        grid.main()
    assert exit_.value.code != 0
    assert "no piece starts with 'nope'" in capsys.readouterr().err


def test_a_whole_name_runs_that_piece_alone_a_prefix_all_it_starts(grid, monkeypatch, capsys):
    def listed(only):
        monkeypatch.setattr("sys.argv", ["longctx_grid.py", "--only", only, "--list"])
        assert grid.main() == 0
        return [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]

    assert listed("prompt-8192") == ["prompt-8192"]  # not also prompt-8192-1.5b
    assert listed("prompt-8192-") == ["prompt-8192-1.5b", "prompt-8192-words", "prompt-8192-1.5b-words"]
    assert set(listed("full-8k")) == {"full-8k"}
    assert set(listed("full-")) >= {"full-2k", "full-8k", "full-8k-1.5b"}


def test_a_re_run_of_a_recipe_writes_its_own_json_on_the_same_prompts(grid):
    # a JSON resumes: a re-run under the first piece's name would keep the rows of the old recipe
    pieces = {name: argv for name, _, argv in grid.PIECES}
    rerun, first = pieces["prompt-8192-words"], pieces["prompt-8192"]
    assert flag(rerun, "--json") == "prompt-8192-words.json" != flag(first, "--json")
    for option in ("--contexts", "--samples", "--tasks", "--split", "--recipe"):
        assert flag(rerun, option) == flag(first, option)


def test_dev_pieces_run_a_length_the_test_split_never_runs(grid):
    test_lengths = {int(c) for _, _, argv in grid.PIECES if "--contexts" in argv for c in flag(argv, "--contexts").split(",")}
    for _, _, argv in grid.DEV_PIECES:
        assert flag(argv, "--split") == "dev"
        assert int(flag(argv, "--contexts")) not in test_lengths


def test_a_missing_peer_venv_stops_with_a_one_line_message(grid, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(grid, "VENVS", tmp_path)  # a checkout with no peer venvs
    monkeypatch.setattr("sys.argv", ["longctx_grid.py", "--out", str(tmp_path), "--only", "openvino-8192"])
    assert grid.main() == 2
    out = capsys.readouterr().out
    assert "is missing (run `make peer-openvino`)" in out and "Traceback" not in out
