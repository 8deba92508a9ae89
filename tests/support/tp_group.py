"""One 2-rank tensor-parallel group (CPU, gloo) shared by the whole test session (``tp_group`` in
conftest.py): starting ranks is the slow part of every TP test (each rank imports torch and
transformers), so the group does all the work that needs a healthy group in one start.

Every rank of the group, in order:

1. generates with tiny Llama and Qwen2 models (2 and 4 KV heads), ``full`` and ``h2o``, runs
   ``eval ppl``, ``bench`` and ``generate`` as commands, and drives the ``serve --tp`` command
   channel with a recording executor; rank 0 saves the results (``TPGroup.results``,
   tests/parallel/test_distributed.py);
2. runs ``h2okv serve --tp 2`` on a tiny chat checkpoint (rank 0 serves HTTP), its prefix store on,
   until rank 0 gets SIGTERM (``TPGroup.serve``, tests/serve/test_tp.py).

The group is started by ``launch.run`` in a thread of the test process (the launcher), so it
runs while the tests use it; the failure tests start their own, light groups.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from argparse import Namespace
from pathlib import Path

import httpx
import pytest
import torch

from h2okv import cli
from h2okv.core.cache import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.models import load_model
from h2okv.parallel import launch
from h2okv.parallel import ranks as tp_ranks
from h2okv.parallel.stats import gather_stats
from h2okv.tools.process import free_port, save_tiny_model
from h2okv.tools.tiny import random_ids, tiny_model, word_tokenizer

# (architecture, KV heads): Llama and Qwen2 with one and two KV heads per rank at --tp 2
MODELS = [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen2", 4)]
PROMPT = 40
NEW_TOKENS = 8
HEAVY = RECENT = 5

# rolling positions (issue 19): a model with a 48-position window generates to 2.5x its window
ROLL_WINDOW, ROLL_NEW_TOKENS = 48, 80

SERVE_NAME = "tiny"
SERVE_HEAVY = SERVE_RECENT = 8
SERVE_CHUNK = 16
SERVE_PREFIX_MEMORY = 16 << 20  # the prefix store on: every rank saves, resumes and forgets the same states
SERVE_SETTINGS = ["--policy", "h2o", "--heavy", str(SERVE_HEAVY), "--recent", str(SERVE_RECENT),
                  "--chunk-size", str(SERVE_CHUNK), "--prefix-cache-memory", str(SERVE_PREFIX_MEMORY)]
# the served checkpoint's context: a stream that a test closes early asks for more tokens than any
# machine decodes while the test looks (the 1,024 positions of the other checkpoints bound it to ~1,000)
SERVE_CONTEXT = 1 << 20


def greedy_new_tokens(model, cache, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """(new tokens, logits per step) of a greedy generation of exactly ``new_tokens`` on the fixed prompt."""
    with torch.inference_mode():
        out = model.generate(random_ids(PROMPT, seed=3), **cache_arg(cache), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, PROMPT:].tolist(), torch.stack(out.logits).float()


def generate_tokens(model, policy):
    """(new tokens, logits per step, cache stats) of a greedy generation on a fixed prompt."""
    kw = {"heavy": HEAVY, "recent": RECENT} if policy == "h2o" else {}
    cache = H2OCache(model, policy=policy, chunk_size=16, **kw)
    return *greedy_new_tokens(model, cache, NEW_TOKENS), cache.stats()


def generate_rolling(model):
    """(new tokens, logits per step, largest position seen) of an h2o generation with rolling positions
    that goes ROLL_NEW_TOKENS past a prompt of PROMPT tokens, far past the model's ROLL_WINDOW."""
    cache = H2OCache(model, policy="h2o", heavy=HEAVY, recent=RECENT, chunk_size=16, positions="rolling")
    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append(int(kwargs["position_ids"].max())), with_kwargs=True)
    try:
        tokens, logits = greedy_new_tokens(model, cache, ROLL_NEW_TOKENS)
    finally:
        hook.remove()
    return tokens, logits, max(seen)


# -- on every rank (module-level: the spawned ranks import them by name) --------------------------
def group_on_rank(args) -> int:
    import torch.distributed as dist

    results = equivalence_on_rank(args)
    if tp_ranks.is_main_rank():
        partial = Path(args.out).with_suffix(".partial")
        torch.save(results, partial)
        partial.rename(args.out)  # whole or absent: the tests wait for it
    # The server's port is chosen now, right before it binds, not when the group was made: the
    # minute of gloo traffic in between opens ephemeral ports, one of which once took the port
    # chosen early, and the group's serve exited 1 before serving (a clean clone's full run).
    port = [free_port() if tp_ranks.is_main_rank() else None]
    dist.broadcast_object_list(port, src=0)
    if tp_ranks.is_main_rank():
        partial = Path(args.port_file).with_suffix(".partial")
        partial.write_text(str(port[0]))
        partial.rename(args.port_file)
    return cli.main([*args.serve, "--port", str(port[0])])


def equivalence_on_rank(args) -> dict:
    """Generate with every model and policy, run `eval ppl`, `bench` and `generate` as commands,
    and drive the serve command channel; returns what the tests compare."""
    import torch.distributed as dist

    results = {}
    for key, path in args.dirs.items():
        model, _ = load_model(path, tp=args.tp, cache=False)
        for policy in ("full", "h2o"):
            tokens, logits, stats = generate_tokens(model, policy)
            results[(key, policy)] = (tokens, logits, gather_stats(stats))
    model, _ = load_model(args.rolling_dir, tp=args.tp, cache=False)
    results["rolling"] = generate_rolling(model)
    for argv in args.commands:
        assert cli.main(argv) == 0
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # what each rank's generate prints
        assert cli.main([*args.generate, "--tp", "2"]) == 0
    results["generate_printed"] = [None, None]
    dist.all_gather_object(results["generate_printed"], printed.getvalue())
    results["channel"] = [None, None]
    dist.all_gather_object(results["channel"], channel_on_rank())
    return results


class RecordingExecutor:
    """A stand-in for the serving executor: records the calls it runs, fails where told to."""

    def __init__(self, rank: int):
        self.rank, self.calls, self.bytes = rank, [], 0

    def open(self, uid: int, size: int) -> None:
        self.calls.append(("open", uid, size))
        self.bytes += size

    def work(self, x: int) -> int:
        self.calls.append(("work", x))
        return 2 * x

    def fail_everywhere(self) -> None:  # bad data: every rank meets the same exception
        self.calls.append(("fail_everywhere",))
        raise ValueError("bad data")

    def fail_on_followers(self) -> None:  # a rank whose state differs from rank 0's
        self.calls.append(("fail_on_followers",))
        if self.rank:
            raise ValueError("only here")

    def kv_bytes(self) -> int:  # read-only (tp.LOCAL_ONLY): never sent to the followers
        return self.bytes

    def sequences(self) -> int:
        return sum(c[0] == "open" for c in self.calls)


def channel_on_rank() -> dict:
    """serve --tp's channel with a recording executor: an idle rank 0 sends heartbeats, calls reach
    the follower in order, a failure on both ranks is survived, a failure on one is a divergence."""
    from h2okv.serve import tp

    rank = tp_ranks.rank()
    channel = tp.Channel(heartbeat_s=0.1)
    executor = RecordingExecutor(rank)
    out: dict = {}
    if rank == 0:
        leader = tp.Leader(executor, channel)
        pinged, send = threading.Semaphore(0), channel.send

        def counting_send(kind, payload=None):
            send(kind, payload)
            if kind == tp.PING:
                pinged.release()

        channel.send = counting_send  # (the heartbeat thread sends through it)
        channel.start_heartbeat()
        # idle: only heartbeats go out, two of them before the first call (a 0.8 s sleep left their
        # count to the machine's speed: a loaded one could send fewer than two in it)
        assert pinged.acquire(timeout=120) and pinged.acquire(timeout=120), "no heartbeats from an idle rank 0"
        leader.open(1, 10)
        out["doubled"] = leader.work(21)
        assert leader.kv_bytes() == 10
        with pytest.raises(ValueError, match="bad data"):
            leader.fail_everywhere()
        leader.open(2, 5)
        out["figures"] = leader.rank_figures()
        leader.fail_on_followers()
        channel.close()
    else:
        kinds = []
        receive = channel.receive

        def recording_receive():
            message = receive()
            kinds.append(message[0])
            return message

        channel.receive = recording_receive
        with pytest.raises(tp.GroupBroken) as info:
            tp.follow(executor, channel, tp.RankFigures(executor, rank))
        out["error"], out["kinds"] = str(info.value), kinds
    out["calls"] = executor.calls
    return out


# -- in the test process -----------------------------------------------------------------------------
def generate_command(dirs: dict) -> list[str]:
    return ["generate", "--model", dirs[("llama", 2)], "--prompt", " ".join(f"w{i}" for i in range(3, 40)),
            "--max-new-tokens", "6", "--heavy", "4", "--recent", "4"]


class TPGroup:
    """The session's group, launched by ``launch.run`` in a thread of this process."""

    def __init__(self, root: Path):
        self.root = root
        self.dirs = {}
        for arch, kv in MODELS:
            path = root / f"{arch}_kv{kv}"
            tiny_model(arch, num_attention_heads=4, num_key_value_heads=kv).save_pretrained(path)
            word_tokenizer().save_pretrained(path)
            self.dirs[(arch, kv)] = str(path)
        self.rolling_dir = root / "llama_kv2_window48"
        tiny_model("llama", num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=ROLL_WINDOW).save_pretrained(self.rolling_dir)
        word_tokenizer().save_pretrained(self.rolling_dir)
        # the served model: a tiny Qwen2 with 4 KV heads (2 per rank) and a byte-level chat tokenizer
        self.checkpoint = save_tiny_model(root / "chat_qwen2_kv4", arch="qwen2", num_key_value_heads=4,
                                          max_positions=SERVE_CONTEXT, initializer_range=0.3)
        self.out = root / "out"
        self.out.mkdir()
        text = self.out / "words.txt"
        text.write_text(" ".join(f"w{2 + (i * 7) % 90}" for i in range(200)))
        model = self.dirs[("llama", 4)]  # (AutoTokenizer gives a Qwen2 directory its own tokenizer class)
        self.commands = {
            "ppl": ["eval", "ppl", "--model", model, "--text", str(text), "--tokens", "48", "--policies", "full,h2o",
                    "--budgets", "0.25", "--plot", "", "--json", str(self.out / "ppl_tp2.json")],
            "bench": ["bench", "--model", model, "--context", "32", "--batch", "2", "--steps", "3", "--warmup", "1",
                      "--no-progress", "--json", str(self.out / "bench_tp2.json")],
        }
        self.port: int | None = None  # rank 0 chooses it right before serving (group_on_rank)
        serve = ["serve", "--model", str(self.checkpoint), "--served-model-name", SERVE_NAME, "--log-level", "warning",
                 *SERVE_SETTINGS, "--tp", "2", "--tp-timeout", "60"]
        self.args = Namespace(tp=2, tp_timeout=600, device="cpu", dirs=self.dirs,
                              rolling_dir=str(self.rolling_dir), out=str(self.out / "tp.pt"),
                              port_file=str(self.out / "serve.port"),
                              commands=[[*argv, "--tp", "2"] for argv in self.commands.values()],
                              generate=generate_command(self.dirs), serve=serve)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name="tp-group-launcher", daemon=True)
        self.thread.start()
        self._results = None
        self.ranks: list[int] | None = None

    def _run(self) -> None:
        self.code = launch.run(self.args, group_on_rank)

    def results(self, timeout: float = 300) -> dict:
        """Step 1's results (waits for them)."""
        if self._results is None:
            path = Path(self.args.out)
            deadline = time.monotonic() + timeout
            while not path.exists():
                assert self.thread.is_alive(), f"the TP group exited with {self.code} before its results"
                assert time.monotonic() < deadline, f"no TP group results within {timeout} s"
                time.sleep(0.2)
            self._results = torch.load(path, weights_only=False)
        return self._results

    def serve(self, timeout: float = 300) -> TPGroup:
        """Step 2: waits until ``serve --tp 2`` is healthy; ``self.ranks`` = [rank 0, rank 1] pids."""
        deadline = time.monotonic() + timeout
        port_file = Path(self.args.port_file)
        while self.port is None:
            assert self.thread.is_alive(), f"the TP group exited with {self.code} before choosing its port"
            assert time.monotonic() < deadline, f"no serving port within {timeout} s"
            if port_file.exists():
                self.port = int(port_file.read_text())
            else:
                time.sleep(0.2)
        while not self._healthy():
            assert self.thread.is_alive(), f"the TP group exited with {self.code} before serving"
            assert time.monotonic() < deadline, f"serve --tp 2 was not healthy within {timeout} s"
            time.sleep(0.2)
        if self.ranks is None:
            ranks = _spawned_children(os.getpid())
            listening = _listening_pid(self.port, ranks)
            self.ranks = [listening, *(p for p in ranks if p != listening)]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def terminate(self) -> None:
        """What ``h2okv serve --tp``'s launcher does with a SIGTERM (tested in test_tp.py):
        pass it to rank 0, which drains and then stops the others."""
        import signal

        os.kill(self.ranks[0], signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The launcher's result: 0 only when every rank exited 0."""
        self.thread.join(timeout)
        return self.code

    def stop(self) -> None:
        if self.thread.is_alive():
            with contextlib.suppress(AssertionError):
                self.serve(timeout=120)
            if self.ranks:
                self.terminate()
            self.wait(120)


def _spawned_children(parent: int) -> list[int]:
    """``parent``'s children that torch.multiprocessing spawned (the ranks)."""
    pids = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return [p for p in pids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def _listening_pid(port: int, candidates: list[int]) -> int:
    """Which of ``candidates`` listens on 127.0.0.1:``port`` (rank 0 binds the server's port)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
            inodes.add(fields[9])
    for pid in candidates:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    return pid
    raise AssertionError(f"none of {candidates} listens on port {port}")
