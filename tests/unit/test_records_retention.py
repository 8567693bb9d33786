"""Rollout records (issue 21): what the writer keeps between ``add`` and ``end_window``.

The trainer hands each trained micro-batch (TRL's dict, pi_theta before backward) to ``RolloutRecordWriter.add``,
which buffers Arrow record batches until the logged step. Those buffers must own their memory: an Arrow array
built zero-copy over a CPU tensor's numpy view pins the tensor's storage (and aliases memory the trainer may still
write) for the whole window. Here every source tensor's storage must be freed once the caller drops the batch, and
no pending Arrow buffer may lie inside a source tensor's storage.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from trl_rollout_corr import records
from trl_rollout_corr.features.rollout_records import micro_batch
from trl_rollout_corr.records import RolloutRecordWriter, open_dump

EOS, PAD = 1, 0


def _inputs(B: int, T: int, P: int = 8):
    """A TRL-like micro-batch of B rows: views (the rows of a 2B-row generation batch, as TRL's split makes them)
    in the dtypes the trainer holds, plus pi_theta carrying its autograd graph (before backward)."""
    g = torch.Generator().manual_seed(0)
    G = 2 * B
    completion_ids = torch.randint(2, 50, (G, T), generator=g)
    completion_mask = torch.ones(G, T, dtype=torch.int64)
    for i in range(G):  # row i generated T - (i % 5) tokens, the last one EOS (rows with i % 5 == 0 are full)
        n = T - (i % 5)
        completion_ids[i, n - 1] = EOS if i % 5 else completion_ids[i, n - 1]
        completion_ids[i, n:] = PAD
        completion_mask[i, n:] = 0
    prompt_mask = torch.ones(G, P, dtype=torch.int64)
    prompt_mask[::2, :3] = 0  # left padding
    gen = dict(
        prompt_ids=torch.randint(2, 50, (G, P), generator=g) * prompt_mask, prompt_mask=prompt_mask,
        completion_ids=completion_ids, completion_mask=completion_mask,
        rollout_log_probs=-torch.rand(G, T, generator=g), old_per_token_logps=-torch.rand(G, T, generator=g),
        ref_per_token_logps=-torch.rand(G, T, generator=g), rollout_is_weights=torch.rand(G, T, generator=g),
        rollout_rs_mask=completion_mask.clone(), advantages=torch.randn(G, generator=g),
        rollout_record_row=torch.arange(G), rollout_record_rewards=torch.rand(G, 2, generator=g),
        rollout_record_times=torch.tensor([[100.0, 102.5]], dtype=torch.float64).expand(G, 2).contiguous(),
        rollout_policy_version=torch.full((G,), 3, dtype=torch.int64),
        tool_mask=torch.ones(G, T, dtype=torch.int64),
    )
    inputs = {k: v[:B] for k, v in gen.items()}  # views of the generation batch's storage, as TRL's split
    inputs["rollout_generation_step"] = 3
    inputs["rollout_record_batch"] = torch.tensor(0)
    weight = torch.randn(B, T, 7, generator=g, requires_grad=True)
    log_probs = torch.log_softmax(weight * 2.0, dim=-1)[..., 0]  # log_softmax saves its output for backward
    return inputs, log_probs, weight


def _ranges(tensors):
    return {k: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for k, t in tensors.items()}


def _pending_buffers(writer):
    out = []
    for batch in writer._batches:
        for column in batch.columns:
            out.extend(b for b in column.buffers() if b is not None and b.size > 0)
    return out


@pytest.mark.parametrize("B", [1, 16])
def test_add_keeps_no_source_tensor_storage_alive_nor_aliases_it(tmp_path, B):
    T = 32
    writer = RolloutRecordWriter(tmp_path / "d", eos_token_ids=[EOS], pad_token_id=PAD, max_completion_length=T)
    writer.write_run_metadata({"schema": records.SCHEMA_NAME, "schema_version": records.SCHEMA_VERSION,
                               "correction": {"mode": "decoupled"}, "trainer": {}, "model": {}, "engine": {}})
    inputs, log_probs, weight = _inputs(B, T)
    sources = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)} | {"log_probs": log_probs}
    storages = {k: weakref.ref(t.untyped_storage()) for k, t in sources.items()}
    ranges = _ranges(sources)
    advantages, version = inputs["advantages"].tolist(), inputs["rollout_policy_version"].tolist()
    assert log_probs.grad_fn is not None

    writer.add(micro_batch(0, inputs, log_probs, trained=inputs))

    buffers = _pending_buffers(writer)
    assert len(buffers) > 20
    aliased = sorted({name for b in buffers for name, (start, size) in ranges.items()
                      if b.address < start + size and start < b.address + b.size})
    assert aliased == []  # every pending Arrow buffer owns its bytes
    del inputs, log_probs, sources
    gc.collect()
    alive = sorted(name for name, ref in storages.items() if ref() is not None)
    assert alive == []  # no tensor, numpy view or autograd node of the batch outlives add()
    assert weight.grad is None

    writer.end_window(1, {"rollout_corr/kl": 0.0})  # the buffered values, written unchanged
    rows = open_dump(tmp_path / "d").read_table().to_pylist()
    assert [r["advantage"] for r in rows] == advantages  # float32 in, float32 out
    assert [r["policy_version"] for r in rows] == version
    assert [(r["generation_start_time"], r["generation_end_time"]) for r in rows] == [(100.0, 102.5)] * B
    assert [len(r["completion_ids"]) for r in rows] == [T - (i % 5) for i in range(B)]
