"""Rollout records (records/): the schema, the writer's layout (unpadded rows, windows, atomic files), and the
reader's validation of bad input (another schema version, a truncated Parquet file, misaligned per-token columns),
each error naming the file and the fix, nothing overwritten."""

from __future__ import annotations

import json
import math
import warnings

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from trl_rollout_corr import records
from trl_rollout_corr.records import (
    COLUMNS,
    PER_TOKEN_COLUMNS,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    MicroBatch,
    RecordsError,
    RolloutRecordWriter,
    completion_lengths,
    open_dump,
    terminations,
)

EOS, PAD = 1, 0


def _batch(step=0, generation_batch=0, per_token=True):
    """2 rows: row 0 generated 3 tokens ending in EOS; row 1 filled max_completion_length=4 (truncated)."""
    completion_ids = torch.tensor([[5, 6, EOS, PAD], [7, 8, 9, 10]])
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    mu = torch.tensor([[-0.5, -1.0, -0.25, 0.0], [-2.0, float("nan"), -0.75, -1.5]])
    extra = dict(old_log_probs=mu + 0.125, log_probs=mu + 0.25, rollout_rs_mask=completion_mask.clone(),
                 tool_mask=None) if per_token else {}
    return MicroBatch(
        step=step, generation_step=step, generation_batch=generation_batch,
        prompt_ids=torch.tensor([[PAD, 3, 4], [2, 3, 4]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        completion_ids=completion_ids, completion_mask=completion_mask, rollout_log_probs=mu,
        advantages=torch.tensor([0.5, -0.5]), generation_row=torch.tensor([1, 0]),
        rewards=torch.tensor([[1.0], [float("nan")]]), times=torch.tensor([[10.0, 12.5], [10.0, 12.5]],
                                                                         dtype=torch.float64),
        per_token=extra,
    )


def _metadata(**correction):
    from trl_rollout_corr.config import RolloutCorrectionConfig

    config = RolloutCorrectionConfig(**correction)
    return {"schema": records.SCHEMA_NAME, "schema_version": SCHEMA_VERSION,
            "correction": {**config.to_dict(), "mode": "bypass" if config.bypass_mode else "decoupled",
                           "length_buckets": [64, 256, 1024]},
            "trainer": {"per_device_train_batch_size": 2, "steps_per_generation": 1}, "model": {}, "engine": {}}


def _writer(path, **kw):
    return RolloutRecordWriter(path, eos_token_ids=[EOS], pad_token_id=PAD, max_completion_length=4, **kw)


# ---------------------------------------------------------------------------------------------- schema
def test_schema_is_versioned_and_has_room_for_lag_support_and_routes():
    assert SCHEMA_VERSION == "1.1"
    names = [c.name for c in COLUMNS]
    assert len(names) == len(set(names))
    for name in ("prompt_ids", "completion_ids", "completion_mask", "rollout_log_probs", "step", "generation_step",
                 "generation_start_time", "generation_end_time", "rewards", "advantage", "termination"):
        assert name in REQUIRED_COLUMNS  # spec section 10's per-sample fields
    reserved = {c.name: c.spec for c in COLUMNS if c.reserved}
    assert reserved == {}  # policy_version_tokens (spec 7) is filled since issue 44
    # 1.1: the columns that follow policy_lag_split, support matching and R3 (optional: adding them is not a break)
    added = {"version_log_probs": "7", "support_log_mass": "8", "support_size": "8", "support_miss": "8",
             "routes_packed": "9"}
    assert {n: COLUMNS[names.index(n)].spec for n in added} == added
    assert all(not COLUMNS[names.index(n)].required for n in [*reserved, *added])
    assert records.arrow_type("list<list<list<int16>>>") == pa.list_(pa.list_(pa.list_(pa.int16())))
    assert records.arrow_type("binary") == pa.binary()
    table = records.schema_markdown()
    assert table.count("\n") == len(COLUMNS) + 1 and "`routes_packed`" in table


def test_routes_pack_to_one_byte_per_expert_id_and_unpack_exactly():
    """Two rows, L=2 layers, k=2: row 0 a 2-token prompt (left-padded by 1) and 2 completion tokens (the last one
    without a route, as generate's final token), row 1 a 3-token prompt and 1 completion token of 2 (padding)."""
    routes = torch.full((2, 5, 2, 2), -1, dtype=torch.int16)
    routes[0, 1:4] = torch.tensor([[[0, 7], [3, 1]], [[2, 2], [6, 5]], [[1, 0], [4, 3]]], dtype=torch.int16)
    routes[1, 0:4] = torch.arange(16, dtype=torch.int16).reshape(4, 2, 2) % 8
    keep = torch.tensor([[False, True, True, True, True], [True, True, True, True, False]])
    column = records.pack_routes(routes, keep, records.routes_encoding(8))
    assert pc.binary_length(column).to_pylist() == [4 * 4, 4 * 4]  # L*k = 4 bytes a token
    assert column[0].as_py() == bytes([0, 7, 3, 1, 2, 2, 6, 5, 1, 0, 4, 3, 255, 255, 255, 255])
    table = pa.table({"routes_packed": column})
    layout = {"encoding": "uint8", "layers": 2, "top_k": 2}
    out = records.unpack_routes(table, layout)
    assert torch.equal(out[0], routes[0, 1:5]) and torch.equal(out[1], routes[1, 0:4])
    assert records.routes_encoding(255) == "uint8" and records.routes_encoding(256) == "int16le"
    wide = records.unpack_routes(pa.table({"routes_packed": records.pack_routes(routes, keep, "int16le")}),
                                 {**layout, "encoding": "int16le"})
    assert torch.equal(wide[0], out[0]) and torch.equal(wide[1], out[1])


def test_completion_lengths_and_termination_by_hand():
    ids = torch.tensor([[5, EOS, PAD, PAD], [5, 6, 7, 8], [5, 6, 7, PAD], [EOS, PAD, PAD, PAD]])
    # row 2: TRL zeroed the mask of a truncated row (mask_truncated_completions); its pads are stripped
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    lengths = completion_lengths(ids, mask, PAD)
    assert lengths.tolist() == [2, 4, 3, 1]
    assert terminations(ids, lengths, 4, [EOS]) == ["eos", "length", "other", "eos"]
    # pad == eos (SmolLM2): the EOS is kept because the mask covers it
    assert completion_lengths(torch.tensor([[5, 1, 1]]), torch.tensor([[1, 1, 0]]), 1).tolist() == [2]


# ---------------------------------------------------------------------------------------------- writer + reader
def test_round_trip_unpadded_rows_windows_and_logs(tmp_path):
    w = _writer(tmp_path / "dump")
    w.write_run_metadata(_metadata())
    w.add(_batch(step=0))
    path = w.end_window(1, {"loss": 0.5, "rollout_corr/kl": 0.25, "text": "ignored"})
    w.add(_batch(step=1, generation_batch=1, per_token=False))  # no optional columns in this micro-batch
    w.end_window(2, {"rollout_corr/kl": 0.125})
    assert w.end_window(2, {"train_runtime": 1.0}) is None  # the Trainer's closing summary log: nothing to write
    assert path.name == "step-00000001.rank-00000.parquet" and w.rows_written == 4 and w.bytes_written > 0

    dump = open_dump(tmp_path / "dump")
    assert [(x.logged_step, x.first_step, len(x.files)) for x in dump.windows] == [(1, 1, 1), (2, 2, 1)]
    assert dump.windows[0].metrics == {"loss": 0.5, "rollout_corr/kl": 0.25}
    rows = dump.read_table().to_pylist()
    r0, r1 = rows[0], rows[1]
    assert r0["prompt_ids"] == [3, 4] and r1["prompt_ids"] == [2, 3, 4]  # left padding removed
    assert r0["completion_ids"] == [5, 6, EOS] and r1["completion_ids"] == [7, 8, 9, 10]
    assert r0["completion_mask"] == [1, 1, 1] and r0["rollout_log_probs"] == [-0.5, -1.0, -0.25]
    assert math.isnan(r1["rollout_log_probs"][1])  # NaN kept: an invalid token, never replaced
    assert r0["old_log_probs"] == [-0.375, -0.875, -0.125] and r0["log_probs"] == [-0.25, -0.75, 0.0]
    assert (r0["termination"], r1["termination"]) == ("eos", "length")
    assert r0["generation_row"] == 1 and r0["advantage"] == 0.5 and r0["rewards"] == [1.0]
    assert math.isnan(r1["rewards"][0])
    assert (r0["generation_start_time"], r0["generation_end_time"]) == (10.0, 12.5)
    assert [r["logged_step"] for r in rows] == [1, 1, 2, 2] and [r["micro_step"] for r in rows] == [0, 0, 1, 1]
    assert rows[2]["old_log_probs"] is None  # an optional column absent from a file reads as null
    assert "tool_mask" not in dump.read_table().column_names
    ds = dump.to_dataset()
    assert len(ds) == 4 and ds[0]["completion_ids"] == [5, 6, EOS]


def test_dump_every_keeps_one_window_in_n(tmp_path):
    w = _writer(tmp_path / "d", every=2)
    w.write_run_metadata(_metadata())
    for step in range(1, 5):
        w.add(_batch(step=step - 1, generation_batch=step - 1))
        w.end_window(step, {"rollout_corr/kl": float(step)})
    dump = open_dump(tmp_path / "d")
    assert [(x.logged_step, x.dumped, len(x.files)) for x in dump.windows] == [
        (1, True, 1), (2, False, 0), (3, True, 1), (4, False, 0)]
    assert set(dump.read_table().column("logged_step").to_pylist()) == {1, 3}
    with pytest.raises(RecordsError, match="rollout_dump_every must be >= 1"):
        _writer(tmp_path / "e", every=0)


def test_nothing_is_overwritten(tmp_path):
    w = _writer(tmp_path / "d")
    w.write_run_metadata(_metadata())
    w.add(_batch())
    w.end_window(1, {"rollout_corr/kl": 0.0})
    run_json = (tmp_path / "d" / "run.json").read_bytes()
    again = _writer(tmp_path / "d")  # a second run into the folder: refused at its first step, 0 (not a resume)
    again.write_run_metadata(_metadata())
    with pytest.raises(RecordsError, match="holds a rollout dump.*step 0.*resume_from_checkpoint=True.*choose"):
        again.add(_batch())
    other_rank = _writer(tmp_path / "d", is_main_process=False)  # another rank of the same run: no check
    other_rank.add(_batch())
    step_file = tmp_path / "d" / "steps" / "step-00000001.rank-00000.parquet"
    before = step_file.read_bytes()
    with pytest.raises(RecordsError, match="already exists; records are never overwritten"):
        other_rank.end_window(1, {})
    assert step_file.read_bytes() == before and (tmp_path / "d" / "run.json").read_bytes() == run_json
    assert not list((tmp_path / "d" / "steps").glob("*.tmp-*"))


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def dump_dir(tmp_path):
    w = _writer(tmp_path / "d")
    w.write_run_metadata(_metadata())
    w.add(_batch())
    w.end_window(1, {"rollout_corr/kl": 0.0})
    return tmp_path / "d"


def test_not_a_dump(tmp_path):
    with pytest.raises(RecordsError, match="no such folder"):
        open_dump(tmp_path / "missing")
    with pytest.raises(RecordsError, match=r"is not a rollout dump \(no run.json\)"):
        open_dump(tmp_path)


def test_another_schema_major_version_names_the_file_and_the_fix(dump_dir):
    run = json.loads((dump_dir / "run.json").read_text())
    run["schema_version"] = "2.0"
    (dump_dir / "run.json").write_text(json.dumps(run))
    with pytest.raises(RecordsError, match=r"run.json: rollout records schema 2.0.*reads schema 1.1.*release that "
                                           r"wrote it"):
        open_dump(dump_dir)
    run["schema_version"] = "1.0"
    (dump_dir / "run.json").write_text(json.dumps(run))
    step_file = next((dump_dir / "steps").iterdir())
    table = pq.read_table(step_file)
    pq.write_table(table.replace_schema_metadata({b"trl_rollout_corr.schema": records.SCHEMA_NAME.encode(),
                                                  b"trl_rollout_corr.schema_version": b"0.9"}), step_file)
    dump = open_dump(dump_dir)
    with pytest.raises(RecordsError, match=rf"{step_file.name}: rollout records schema 0.9"):
        dump.read_table()


def test_newer_minor_version_is_read_with_a_warning(dump_dir):
    step_file = next((dump_dir / "steps").iterdir())
    table = pq.read_table(step_file).append_column("future_column", pa.array([1, 2], pa.int64()))
    pq.write_table(table.replace_schema_metadata({b"trl_rollout_corr.schema": records.SCHEMA_NAME.encode(),
                                                  b"trl_rollout_corr.schema_version": b"1.7"}), step_file)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = open_dump(dump_dir).read_table()
    assert any("newer than 1.1" in str(w.message) for w in caught)
    assert "future_column" not in table.column_names and table.num_rows == 2


def test_truncated_parquet_names_the_file(dump_dir):
    step_file = next((dump_dir / "steps").iterdir())
    data = step_file.read_bytes()
    step_file.write_bytes(data[: len(data) // 2])
    dump = open_dump(dump_dir)  # opening reads only run.json and logs.jsonl
    with pytest.raises(RecordsError, match=rf"{step_file.name}: not a readable Parquet file.*truncated or corrupt"):
        dump.read_table()


def test_corrupt_run_json_and_logs_name_the_line(dump_dir):
    (dump_dir / "logs.jsonl").write_text('{"logged_step": 1, "first_step": 1, "metrics": {}}\n{"logged_st')
    with pytest.raises(RecordsError, match=r"logs.jsonl:2: not a logs.jsonl line"):
        open_dump(dump_dir)
    (dump_dir / "run.json").write_text('{"schema": ')
    with pytest.raises(RecordsError, match=r"run.json:1:\d+: not valid JSON"):
        open_dump(dump_dir)


def test_misaligned_per_token_column_names_the_row(dump_dir):
    step_file = next((dump_dir / "steps").iterdir())
    table = pq.read_table(step_file)
    bad = pa.array([[-0.5, -1.0, -0.25], [-1.0]], pa.list_(pa.float32()))
    table = table.set_column(table.schema.get_field_index("log_probs"), "log_probs", bad)
    pq.write_table(table, step_file)
    with pytest.raises(RecordsError, match=r"row 1: column 'log_probs' has 1 entries for 4 completion tokens"):
        open_dump(dump_dir).read_table()
    assert set(PER_TOKEN_COLUMNS) >= {"log_probs", "old_log_probs", "rollout_log_probs", "completion_mask"}


def test_wrong_column_type_and_missing_required_column(dump_dir):
    step_file = next((dump_dir / "steps").iterdir())
    table = pq.read_table(step_file)
    meta = table.schema.metadata
    pq.write_table(table.set_column(table.schema.get_field_index("step"), "step",
                                    pa.array(["a", "b"])).replace_schema_metadata(meta), step_file)
    with pytest.raises(RecordsError, match=r"column 'step' has type string, expected int64"):
        open_dump(dump_dir).read_table()
    pq.write_table(table.drop_columns(["advantage"]).replace_schema_metadata(meta), step_file)
    with pytest.raises(RecordsError, match=r"required column 'advantage' is missing"):
        open_dump(dump_dir).read_table()


def test_rows_without_a_logged_step_are_read_with_a_warning(dump_dir):
    (dump_dir / "logs.jsonl").unlink()  # the run stopped after writing its rows, before logging
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dump = open_dump(dump_dir)
    assert any("no logged values to check" in str(w.message) for w in caught)
    assert [(w.logged_step, w.metrics) for w in dump.windows] == [(1, {})]


def test_a_resumed_run_continues_the_dump(tmp_path):
    """Issue 22: a run resumed from a checkpoint with the same rollout_dump_dir was refused, so a crashed run could
    not continue its dump. Now: same run_id, the interrupted run's windows after the checkpoint moved aside (no
    step twice), generation batches numbered after the kept ones, the window count of rollout_dump_every kept."""
    d = tmp_path / "d"
    first = _writer(d)
    first.write_run_metadata(_metadata())
    for step in range(4):  # steps 0..3 trained, windows 1..4 logged, then the run dies (checkpoint at step 2)
        first.add(_batch(step=step, generation_batch=step))
        first.end_window(step + 1, {"rollout_corr/kl": float(step)})
    run_id = json.loads((d / "run.json").read_text())["run_id"]
    assert len(run_id) == 32
    resumed = _writer(d)
    resumed.write_run_metadata(_metadata())  # the same settings: accepted, run.json untouched
    for step in (2, 3):  # resumed from checkpoint-2: trains steps 2 and 3 again, its generation batches from 0
        resumed.add(_batch(step=step, generation_batch=step - 2))
        resumed.end_window(step + 1, {"rollout_corr/kl": 10.0 + step})
    dump = open_dump(d)
    assert dump.metadata["run_id"] == run_id
    assert [(w.logged_step, w.first_step, w.metrics["rollout_corr/kl"]) for w in dump.windows] == [
        (1, 1, 0.0), (2, 2, 1.0), (3, 3, 12.0), (4, 4, 13.0)]  # each step once: the resumed run's 3 and 4
    rows = dump.read_table().to_pylist()
    assert [(r["logged_step"], r["generation_batch"]) for r in rows] == [(1, 0), (1, 0), (2, 1), (2, 1), (3, 2),
                                                                         (3, 2), (4, 3), (4, 3)]
    aside = d / "superseded" / "resume-at-00000002"
    assert sorted(p.name for p in aside.iterdir()) == ["logs.jsonl", "resume.rank-00000.json",
                                                       "step-00000003.rank-00000.parquet",
                                                       "step-00000004.rank-00000.parquet"]
    report = json.loads((aside / "resume.rank-00000.json").read_text())  # the moved rows, counted
    assert (report["superseded_rows"], report["restored_rows"], report["restored_from"]) == (4, 0, None)
    assert [(m["file"], m["rows"], m["rows_after_checkpoint"]) for m in report["moved"]] == [
        ("superseded/resume-at-00000002/step-00000003.rank-00000.parquet", 2, 2),
        ("superseded/resume-at-00000002/step-00000004.rank-00000.parquet", 2, 2)]
    assert [json.loads(line)["logged_step"] for line in (aside / "logs.jsonl").read_text().splitlines()] == [3, 4]
    assert json.loads((d / "logs.jsonl").read_text().splitlines()[2])["resumed_at_step"] == 2
    # another run's settings are refused, naming the field; so is another schema version
    other = _writer(d)
    with pytest.raises(RecordsError, match=r"other settings \(correction: rollout_is: stored None, this run 'token'"):
        other.write_run_metadata(_metadata(rollout_is="token"))
    with pytest.raises(RecordsError, match=r"other settings \(rollout_dump_every: stored 1, this run 2"):
        _writer(d, every=2).write_run_metadata(_metadata())
    run = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps({**run, "schema_version": "1.2"}))
    with pytest.raises(RecordsError, match="a resumed run can only continue a dump of its own schema"):
        _writer(d).write_run_metadata(_metadata())


def test_dump_every_counts_on_across_a_resume(tmp_path):
    d = tmp_path / "d"
    first = _writer(d, every=2)
    first.write_run_metadata(_metadata())
    for step in range(3):  # windows 1 (kept), 2 (skipped), 3 (kept)
        first.add(_batch(step=step, generation_batch=step))
        first.end_window(step + 1, {"rollout_corr/kl": 0.0})
    resumed = _writer(d, every=2)
    resumed.write_run_metadata(_metadata())
    for step in (2, 3):  # resumed at checkpoint 2: window 3 again (kept), window 4 (skipped)
        resumed.add(_batch(step=step, generation_batch=step - 2))
        resumed.end_window(step + 1, {"rollout_corr/kl": 1.0})
    assert [(w.logged_step, w.dumped) for w in open_dump(d).windows] == [(1, True), (2, False), (3, True),
                                                                         (4, False)]


def _logging_every_2(writer, steps, save_at=3, stop_after=None):
    """Train ``steps`` (0-based learner steps at use, one 2-row micro-batch each) with logging_steps 2 and a checkpoint
    after update ``save_at``; the run dies right after the checkpoint when ``stop_after == save_at``."""
    for step in steps:
        writer.add(_batch(step=step, generation_batch=step - steps[0]))
        if (step + 1) % 2 == 0:
            writer.end_window(step + 1, {"rollout_corr/kl": float(step)})
        if step + 1 == save_at:
            writer.save_open_window(save_at)
        if stop_after is not None and step + 1 >= stop_after:
            return


@pytest.mark.parametrize("died", ["inside_the_window", "after_the_window"])
def test_a_resume_inside_a_logging_window_keeps_the_steps_before_the_checkpoint(tmp_path, died):
    """logging_steps 2, save_steps 3: checkpoint-3 falls inside the window of steps 3..4 (updates, 1-based). The
    interrupted run dies right after the checkpoint (its update-3 rows only in the open-window file) or after update
    5 (window 4 written). Resumed from checkpoint-3, the dump's rows equal the uninterrupted run's: window 4 holds
    updates 3 (restored) and 4 (trained again); the interrupted run's window 4 is moved aside and counted."""
    full = _writer(tmp_path / "full")
    full.write_run_metadata(_metadata())
    _logging_every_2(full, range(4))
    d = tmp_path / "d"
    first = _writer(d)
    first.write_run_metadata(_metadata())
    _logging_every_2(first, range(5), stop_after=3 if died == "inside_the_window" else 5)
    open_window = d / "open-window" / "checkpoint-00000003.rank-00000.parquet"
    if died == "inside_the_window":  # the buffered update-3 rows (step column 2) of the still open window 3..4
        assert pq.read_table(open_window).column("step").to_pylist() == [2, 2]
        assert sorted(p.name for p in (d / "steps").iterdir()) == ["step-00000002.rank-00000.parquet"]
    else:  # removed once window 4 was written: its step file holds the rows
        assert not open_window.exists()
    resumed = _writer(d)
    resumed.write_run_metadata(_metadata())
    _logging_every_2(resumed, range(3, 4), save_at=None)
    assert not open_window.exists()  # window 4 written: the copy removed
    dump, expected = open_dump(d), open_dump(tmp_path / "full")
    assert [(w.logged_step, w.first_step, w.logged_first_step) for w in dump.windows] == [(2, 1, 1), (4, 3, 4)]
    assert [(w.logged_step, w.first_step) for w in expected.windows] == [(2, 1), (4, 3)]
    rows = dump.read_table()
    assert [(r["logged_step"], r["step"], r["generation_batch"], r["micro_step"]) for r in rows.to_pylist()] == [
        (2, 0, 0, 0), (2, 0, 0, 0), (2, 1, 1, 1), (2, 1, 1, 1), (4, 2, 2, 2), (4, 2, 2, 2), (4, 3, 3, 3), (4, 3, 3, 3)]
    assert rows.schema.equals(expected.read_table().schema)  # every column and value (repr: NaN == NaN here)
    assert repr(rows.to_pylist()) == repr(expected.read_table().to_pylist())
    aside = d / "superseded" / "resume-at-00000003"
    report = json.loads((aside / "resume.rank-00000.json").read_text())
    assert report["restored_rows"] == 2 and report["open_window_first_step"] == 3
    if died == "inside_the_window":
        assert report["restored_from"] == "open-window/checkpoint-00000003.rank-00000.parquet"
        assert report["moved"] == [] and report["superseded_rows"] == 0
    else:  # the interrupted run's window 4 (updates 3 and 4: 2 rows taken back, 2 of update 4 superseded)
        assert report["restored_from"] == "superseded/resume-at-00000003/step-00000004.rank-00000.parquet"
        assert report["moved"] == [{"file": report["restored_from"], "rows": 4, "rows_after_checkpoint": 2}]
        assert report["superseded_rows"] == 2
        assert pq.read_table(aside / "step-00000004.rank-00000.parquet").column("step").to_pylist() == [2, 2, 3, 3]
        assert json.loads((aside / "logs.jsonl").read_text())["logged_step"] == 4
    assert json.loads((d / "logs.jsonl").read_text().splitlines()[1])["resumed_at_step"] == 3


def test_a_resume_inside_a_window_whose_rows_are_in_no_file_names_the_fix(tmp_path):
    """The open window's rows lost (the interrupted run died between its checkpoint and the open-window file, or a
    dump of a writer without them): refused at the resumed run's first step, naming the steps and the fix; a window
    that rollout_dump_every does not keep needs no rows."""
    d = tmp_path / "d"
    first = _writer(d)
    first.write_run_metadata(_metadata())
    _logging_every_2(first, range(3), stop_after=3)
    (d / "open-window" / "checkpoint-00000003.rank-00000.parquet").unlink()
    resumed = _writer(d)
    resumed.write_run_metadata(_metadata())
    with pytest.raises(RecordsError, match=r"resuming at step 3, the rows rank 0 trained at steps 3\.\.3 .* are in "
                                           r"no file of the dump.*save_steps a multiple of logging_steps"):
        resumed.add(_batch(step=3))
    skipped = _writer(tmp_path / "e", every=2)  # window 2 kept, window 4 (the open one) not: nothing saved
    skipped.write_run_metadata(_metadata())
    _logging_every_2(skipped, range(3), stop_after=3)
    assert not (tmp_path / "e" / "open-window").exists()
    again = _writer(tmp_path / "e", every=2)
    again.write_run_metadata(_metadata())
    _logging_every_2(again, range(3, 4), save_at=None)
    assert [(w.logged_step, w.first_step, w.dumped) for w in open_dump(tmp_path / "e").windows] == [
        (2, 1, True), (4, 3, False)]


def test_a_resume_moves_the_open_window_of_a_later_checkpoint_aside_and_counts_its_rows(tmp_path):
    """The interrupted run went on to checkpoint-9 (inside window 9..10) and died: resumed from checkpoint-3, its
    windows 4, 6, 8 and its open-window file of checkpoint 9 move aside; the superseded rows are those of updates 4..9
    (2 rows each), the open-window file's counted once (no step file holds them)."""
    d = tmp_path / "d"
    first = _writer(d)
    first.write_run_metadata(_metadata())
    for step in range(9):
        first.add(_batch(step=step, generation_batch=step))
        if (step + 1) % 2 == 0:
            first.end_window(step + 1, {"rollout_corr/kl": 0.0})
        if (step + 1) % 3 == 0:
            first.save_open_window(step + 1)
    assert sorted(p.name for p in (d / "open-window").iterdir()) == ["checkpoint-00000009.rank-00000.parquet"]
    resumed = _writer(d)
    resumed.write_run_metadata(_metadata())
    resumed.add(_batch(step=3, generation_batch=0))
    report = json.loads((d / "superseded" / "resume-at-00000003" / "resume.rank-00000.json").read_text())
    assert [(m["file"].split("/", 2)[2], m["rows"], m["rows_after_checkpoint"]) for m in report["moved"]] == [
        ("step-00000004.rank-00000.parquet", 4, 2), ("step-00000006.rank-00000.parquet", 4, 4),
        ("step-00000008.rank-00000.parquet", 4, 4), ("open-window/checkpoint-00000009.rank-00000.parquet", 2, 2)]
    assert (report["restored_rows"], report["superseded_rows"]) == (2, 12)  # update 3 back; updates 4..9 aside
    assert report["restored_from"] == "superseded/resume-at-00000003/step-00000004.rank-00000.parquet"
    # the open window as checkpoint-3 held it, written again (a second crash before window 4 keeps it)
    assert pq.read_table(d / "open-window" / "checkpoint-00000003.rank-00000.parquet").column("step").to_pylist() == [
        2, 2]


@pytest.mark.parametrize("bypass", [False, True])
def test_analyze_and_suggest_count_the_restored_rows_of_a_resumed_window(tmp_path, bypass):
    """The resumed dump of ``test_a_resume_inside_a_logging_window_keeps_the_steps_before_the_checkpoint`` holds the
    uninterrupted run's 8 rows (4 steps x 2 rows, 3 valid tokens each: row 1's mu is NaN at one token), so analyze's
    total and ``--suggest``'s population are the uninterrupted dump's: 24 tokens, 8 rows, equal to the sum over the
    lag slices. Only the check against the logged values leaves update 3 out of window 4 (its logged values cover
    update 4 only): per step, 12 and 6 tokens. Failed before: the total left the restored rows out (18 tokens, 6 rows,
    while by lag counted 24) and bypass --suggest read its threshold off 24 tokens but re-applied it to 18."""
    from trl_rollout_corr.analyze import NamedConfig, Recomputer, summary_row
    from trl_rollout_corr.suggest import suggest

    metadata = _metadata(bypass_mode=bypass, rollout_is="token", rollout_is_threshold=2.0)
    full = _writer(tmp_path / "full")
    full.write_run_metadata(metadata)
    _logging_every_2(full, range(4))
    d = tmp_path / "d"
    first = _writer(d)
    first.write_run_metadata(metadata)
    _logging_every_2(first, range(5), stop_after=3)
    resumed = _writer(d)
    resumed.write_run_metadata(metadata)
    _logging_every_2(resumed, range(3, 4), save_at=None)
    expected = None
    for path in (tmp_path / "full", d):
        dump = open_dump(path)
        analysis = Recomputer(dump).analyse(NamedConfig("trained", dump.correction_config()), dump.length_buckets)
        total = summary_row(analysis.total)
        assert (total["valid_tokens"], total["valid_rows"]) == (24, 8), path.name
        assert sum(summary_row(p)["valid_tokens"] for p in analysis.by_lag.values()) == 24
        per_step = [summary_row(analysis.per_window[w.logged_step])["valid_tokens"] for w in analysis.windows]
        assert per_step == ([12, 12] if path.name == "full" else [12, 6]), path.name
        expected = expected or analysis.total.metrics()  # every total value: the uninterrupted dump's
        assert analysis.total.metrics() == pytest.approx(expected, abs=1e-7), path.name
        (s,) = suggest(dump, keep=1.0, options=["token_k2"]).direct
        assert s.population == 24 and summary_row(s.analysis.total)["valid_tokens"] == 24, path.name


def test_a_loss_steps_support_columns_reach_its_records_also_through_the_lag_filters_copy():
    """Bypass with support matching, ``num_iterations=2``: the micro-batch TRL holds keeps the first use's support
    columns; at the second use ``max_policy_lag`` drops a now-stale row, so the mode trains on a shallow copy
    (``LossStep.inputs``, ``lag.drop_stale_rows``). The second use's measured score (hand values) must be what its
    records hold; before the fix it went to ``LossStep.original`` only while the records read the copy first, so
    they held the first use's columns."""
    import types

    from trl_rollout_corr.features.rollout_records import RolloutRecords
    from trl_rollout_corr.hooks import LossStep

    first = {name: torch.full((2, 3), value) for name, value in (("log_mass", -0.5), ("size", 4.0), ("miss", 0.0))}
    second = types.SimpleNamespace(log_mass=torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, -0.6]]),
                                   size=torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
                                   miss=torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    original = {"prompt_ids": torch.ones(2, 2, dtype=torch.long), "prompt_mask": torch.ones(2, 2, dtype=torch.long),
                "completion_ids": torch.ones(2, 3, dtype=torch.long), "completion_mask": torch.ones(2, 3),
                "rollout_log_probs": torch.full((2, 3), -1.0), "advantages": torch.tensor([1.0, -1.0]),
                "rollout_generation_step": torch.tensor(4), "rollout_record_batch": torch.tensor(0),
                "rollout_record_row": torch.arange(2), "rollout_policy_version": torch.tensor([4, 3]),
                **{f"rollout_record_support_{name}": value for name, value in first.items()}}
    trained = {**original, "tool_mask": torch.tensor([[1.0] * 3, [0.0] * 3])}  # row 1 stale: out of the loss
    added = []
    features = RolloutRecords.__new__(RolloutRecords)
    features.writer, features.num_experts = types.SimpleNamespace(add=added.append), None
    trainer = types.SimpleNamespace(metrics_mode="train", state=types.SimpleNamespace(global_step=5))
    step = LossStep(original=original, inputs=trained, policy_log_probs=torch.full((2, 3), -0.9), support=second)
    features.after_loss(trainer, step)
    (record,) = added
    for name in ("log_mass", "size", "miss"):
        assert torch.equal(record.per_token[f"support_{name}"], getattr(second, name)), name
    for batch in (original, trained):  # both hold the latest use's columns
        assert batch["rollout_record_support_size"] is second.size
