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
