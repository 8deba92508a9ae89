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
    batch = policy.pool(mass, real)
    for row, n in enumerate(real.tolist()):
        alone = policy.pool(mass[row:row + 1, :, :n], torch.tensor([n]))
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
    pooled = policy.pool(mass, torch.tensor([12, 8]))
    assert pooled[0, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    assert pooled[1, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]  # row 1 ends at 8: no pad is a neighbour
