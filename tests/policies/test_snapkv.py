"""``snapkv``'s look-back ranking (policies/snapkv.py)."""

import torch


def test_pooling_a_padded_row_equals_pooling_it_alone():
    """A row's pads (after its real tokens) are not neighbours: its last tokens' pooled scores are
    those of the row alone, exactly (a padded batch decodes like its rows one by one)."""
    from h2okv.policies import make_policy

    policy = make_policy("snapkv:kernel=7")
    mass = torch.rand(3, 2, 12)
    real = torch.tensor([12, 5, 9])
    mass[1, :, 5:] = 0.0  # pads see nothing
    mass[2, :, 9:] = 0.0
    batch = policy.smooth(mass, real)
    for row, n in enumerate(real.tolist()):
        alone = policy.smooth(mass[row:row + 1, :, :n], torch.tensor([n]))
        assert torch.equal(batch[row, :, :n], alone[0])


def test_max_pooling_keeps_a_chosen_tokens_span_and_is_named_in_the_spec():
    """``pool=max``: every token within kernel // 2 of a high-mass token takes its mass, so the
    whole span around a chosen token ranks with it (a value of many tokens is kept whole); the
    default (avg, SnapKV's) is not written into the spec, so existing rows keep their names."""
    from h2okv.policies import make_policy

    policy = make_policy("snapkv:kernel=5,pool=max")
    assert policy.spec == "snapkv:window=32,kernel=5,pool=max"
    assert make_policy("snapkv").spec == "snapkv:window=32,kernel=7"
    mass = torch.zeros(2, 1, 12)
    mass[:, 0, 6] = 1.0
    pooled = policy.smooth(mass, torch.tensor([12, 8]))
    assert pooled[0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    assert pooled[1, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]  # row 1 ends at 8: no pad is a neighbour


def test_chunks_share_their_mean_and_a_padded_row_is_ranked_as_alone():
    """``chunk=C`` (ChunkKV): every token of an aligned block of C real tokens takes the block's mean,
    so a block is evicted or kept as one span; a row's last, shorter block is the mean of what it
    holds, and a padded row's blocks equal the row's alone."""
    from h2okv.policies import make_policy

    policy = make_policy("snapkv:kernel=1,chunk=4")
    assert policy.spec == "snapkv:window=32,kernel=1,chunk=4"
    mass = torch.arange(10, dtype=torch.float32).view(1, 1, 10).repeat(2, 2, 1)
    mass[1, :, 6:] = 0.0  # row 1 holds 6 real tokens
    got = policy.chunk_mean(mass, torch.tensor([10, 6]))
    own = 1e-3 * mass  # the tie-break inside a block: its weakest token goes first
    torch.testing.assert_close(got[0, 0] - own[0, 0], torch.tensor([1.5] * 4 + [5.5] * 4 + [8.5] * 2))
    torch.testing.assert_close(got[1, 0] - own[1, 0], torch.tensor([1.5] * 4 + [4.5] * 2 + [0.0] * 4))
    assert all(got[0, 0, i] < got[0, 0, i + 1] for i in range(9))  # no two keys equal
    alone = policy.chunk_mean(mass[1:, :, :6], torch.tensor([6]))
    assert torch.equal(got[1, :, :6], alone[0])


def test_a_chunked_value_survives_whole_where_token_ranking_splits_it():
    """A planted 8-token value whose mass is high only at its edges: ranking token by token keeps
    the edges and drops its middle; with chunk=8 aligned on it, the whole value is kept."""
    from h2okv.policies import make_policy

    mass = torch.full((1, 1, 32), 0.1)
    mass[0, 0, 8:16] = torch.tensor([3.0, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 3.0])
    mass[0, 0, 20] = 0.9  # one other good token
    mass[0, 0, 24:32] = 0.3  # a block of middling tokens
    keep = 8
    for spec, want_whole in (("snapkv:kernel=1", False), ("snapkv:kernel=1,chunk=8", True)):
        policy = make_policy(spec)
        new = policy.chunk_mean(mass, torch.tensor([32])) if policy.chunk > 1 else mass
        kept = set(new[0, 0].topk(keep).indices.tolist())
        assert (set(range(8, 16)) <= kept) is want_whole
