"""The step's tokens are sampled for all rows at once: each row's choice is the one the former
per-row sampler made with the same generator, whatever the batch, and the step reads the device
once (``.tolist()``), not once per row."""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from h2okv.serve.sampling import GREEDY_BELOW, INVALID, argmax_ids, make_generator, sample_batch

SETTINGS = [(0.0, 1.0), (1e-6, 0.5), (0.5, 1.0), (1.0, 0.9), (2.0, 0.3), (1.0, 5e-324), (0.7, 1.0), (0.0, 0.9)]


def one_row(logits, temperature, top_p, generator):
    """The former per-row sampler (a host read per row), the reference for every row's choice."""
    if temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


def steps_of(logits, settings, seeds, batched):
    """Each row's tokens over the steps of ``logits`` ``[steps, rows, vocab]``."""
    gens = [make_generator(seed, "cpu") for seed in seeds]
    temps, top_ps = [t for t, _ in settings], [p for _, p in settings]
    out = []
    for step in logits:
        if batched:
            out.append(sample_batch(step, temps, top_ps, gens))
        else:
            out.append([one_row(row, t, p, g) for row, t, p, g in zip(step, temps, top_ps, gens, strict=True)])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_chooses_what_the_per_row_sampler_chose(dtype):
    # sharp logits (scale 4) and flat ones (ties, in bfloat16) over enough steps that the draws vary
    logits = (torch.randn(30, len(SETTINGS), 64, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    seeds = list(range(100, 100 + len(SETTINGS)))
    batched = steps_of(logits, SETTINGS, seeds, batched=True)
    assert batched == steps_of(logits, SETTINGS, seeds, batched=False)
    assert all(len({step[i] for step in batched}) > 1 for i in (2, 3, 4))  # the sampled rows did sample


def test_a_sampled_rows_tokens_do_not_depend_on_its_batchmates():
    g = torch.Generator().manual_seed(1)
    mine = torch.randn(20, 1, 50, generator=g)
    others = torch.randn(20, 3, 50, generator=g)
    alone = steps_of(mine, [(1.0, 0.9)], [7], batched=True)
    batch = steps_of(torch.cat([others[:, :1], mine, others[:, 1:]], dim=1),
                     [(1.0, 1.0), (1.0, 0.9), (0.0, 1.0), (0.8, 0.5)], [3, 7, 4, 5], batched=True)
    assert [step[1] for step in batch] == [step[0] for step in alone]
    assert len({step[0] for step in alone}) > 1  # it did sample


def test_a_nan_row_is_invalid_alone():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    clean = sample_batch(logits, [1.0, 1.0, 0.0, 1.0], [1.0, 0.9, 1.0, 0.5], [make_generator(s, "cpu") for s in range(4)])
    logits[1, 7] = float("nan")
    tokens = sample_batch(logits, [1.0, 1.0, 0.0, 1.0], [1.0, 0.9, 1.0, 0.5], [make_generator(s, "cpu") for s in range(4)])
    assert tokens[1] == INVALID and tokens[:1] + tokens[2:] == clean[:1] + clean[2:]


class HostReads(TorchDispatchMode):
    """Counts reads of one element to the host (``int(t)``, ``t.item()``: ``_local_scalar_dense``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_no_row_is_read_on_its_own():
    logits = torch.randn(len(SETTINGS), 64)
    gens = [make_generator(s, "cpu") for s in range(len(SETTINGS))]
    with HostReads() as reads:
        sample_batch(logits, [t for t, _ in SETTINGS], [p for _, p in SETTINGS], gens)
    assert reads.count == 0
    with HostReads() as reads:  # the check sees a per-row read
        one_row(logits[0], 0.0, 1.0, gens[0])
    assert reads.count == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device counts its synchronisations")
def test_one_device_sync_a_step():
    logits = torch.randn(len(SETTINGS), 1000, device="cuda")
    gens = [make_generator(s, "cuda") for s in range(len(SETTINGS))]

    def syncs(fn):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message) for w in caught)

    one_copy = syncs(lambda: logits.argmax(-1).tolist())
    assert one_copy >= 1
    assert syncs(lambda: sample_batch(logits, [t for t, _ in SETTINGS], [p for _, p in SETTINGS], gens)) == one_copy


def test_the_argmax_of_cpu_float32_logits_is_torchs():
    """``argmax_ids`` (numpy's argmax for float32 logits on the CPU, torch's otherwise) picks what
    ``logits.argmax(-1)`` picks: the first of tied maxima, the first NaN, a row of -inf's first."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 259, generator=g)
    logits[1, [3, 200]] = 50.0  # a tie
    logits[2, [7, 9]] = float("nan")
    logits[3] = float("-inf")
    logits[4, 5] = float("inf")
    for rows in (logits, logits.double(), logits.half(), torch.randn(8, 2, 259, generator=g)[:, -1]):
        assert argmax_ids(rows) == rows.argmax(-1).tolist()
