"""The generated reference pages (``trl_rollout_corr/docgen_pages.py``) say what the code says: the trainer's own
fields with TRL's field they redefine, each preset's fields, the recorded trainer fields of ``run.json`` and the
metric catalogue (whose keys ``tests/unit/test_metric_catalog.py`` checks against the logged ones)."""

from __future__ import annotations

import dataclasses

from trl_rollout_corr import docgen_pages


def _section(page: str, heading: str) -> str:
    return page.split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]


def test_trainer_fields_page_lists_the_fields_beyond_grpo_config():
    from trl import GRPOConfig

    from trl_rollout_corr.config import CORRECTION_FIELDS
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    page = docgen_pages.trainer_fields_page()
    trl = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = [f.name for f in dataclasses.fields(RolloutCorrGRPOConfig) if f.name not in trl and
           f.name not in CORRECTION_FIELDS]
    assert {"rollout_corr_preset", "rs_keep_rejected_in_baseline", "skip_empty_steps", "rollout_async_depth"} <= set(
        own)
    for name in own:
        assert f"\n### `{name}`\n" in page, name
    assert _section(page, "### `rollout_dump_every`") == (
        "\n* type `int`, default `1`\n"
        "* With rollout_dump_dir: keep the rows of one logged window in N (bounds the dump size).\n")
    assert _section(page, "### `rollout_async_timeout_s`").startswith("\n* type `float`, default `600.0`\n")
    # TRL's field redefined with another type and default is listed with TRL's
    assert _section(page, "### `vllm_importance_sampling_correction`").startswith(
        "\n* type `Optional[bool]`, default `None` (redefines TRL's `GRPOConfig.vllm_importance_sampling_correction`: "
        "type `bool`,\n  default `True`)\n")
    assert "### `learning_rate`" not in page  # TRL's own, unchanged
    assert "* `rollout_rs_on`: type `Optional[str]`, default `None` (core default `'direct'`)" in page


def test_presets_page_lists_each_preset_and_its_fields():
    from trl_rollout_corr.config import PRESETS

    page = docgen_pages.presets_page()
    assert [line[4:-1] for line in page.splitlines() if line.startswith("## `")] == list(PRESETS)
    assert _section(page, "## `decoupled_k3_rs_token_tis`") == (
        "\n`RolloutCorrectionConfig.decoupled_k3_rs_token_tis(is_threshold=2.0, rs_threshold=0.01)`\n\n"
        "``seq_mean_k3`` rejection plus token TIS (this project's CPU default).\n\n"
        "* `rollout_is`: `'token'`\n* `rollout_is_threshold`: `2.0`\n* `rollout_rs`: `'seq_mean_k3'`\n"
        "* `rollout_rs_threshold`: `0.01`\n")
    assert _section(page, "## `bypass_ppo_clip`").endswith(
        "* `bypass_mode`: `True`\n* `bypass_loss_type`: `'ppo_clip'`\n")
    assert _section(page, "## `direct_double_sided`").endswith(
        "* `rollout_is`: `'token'`\n* `rollout_is_threshold`: `(0.8, 1.2)`\n* `bypass_mode`: `True`\n"
        "* `bypass_loss_type`: `'reinforce'`\n")


def test_recorded_fields_page_follows_recorded_trainer_fields():
    from trl_rollout_corr.features.rollout_records import RECORDED_TRAINER_FIELDS

    page = docgen_pages.recorded_fields_page()
    assert [line[5:-1] for line in page.splitlines() if line.startswith("### `")] == list(RECORDED_TRAINER_FIELDS)
    assert _section(page, "### `max_policy_lag`").startswith(
        "\n* type `Optional[int]`, default `None`; from `RolloutCorrGRPOConfig`\n")
    assert _section(page, "### `num_iterations`").startswith("\n* type `int`, default `1`; from TRL's `GRPOConfig`\n")


def test_metrics_page_lists_every_family_once():
    from trl_rollout_corr.metric_catalog import METRICS

    page = docgen_pages.metrics_page()
    for m in METRICS:
        assert page.count(f"* `{m.listed}`: ") == 1, m.pattern
    headings = [line[3:] for line in page.splitlines() if line.startswith("## ")]
    assert headings == ["Off-policy diagnostics", "Importance-sampling weights", "Rejection sampling", "Length slices",
                        "Ratio decomposition and policy lag", "Trainer features", "Asynchronous generation",
                        "In-process vLLM CPU engine"]
    assert "\n* `skipped_step_fraction`: 1 on an optimizer step `skip_empty_steps` skipped, else 0 " \
           "(features/empty_steps.py)\n\n## Asynchronous generation\n\nLogged only with `rollout_async_depth >= 1`" \
           in page
    section = _section(page, "## Asynchronous generation")
    assert "`trainer_wait_s` ~ 0 means generation keeps up" in section.replace("\n", " ")
    assert [line.split("`")[1] for line in section.splitlines() if line.startswith("* ")] == [
        "rollout_async/trainer_wait_s", "rollout_async/engine_idle_s", "rollout_async/generate_s",
        "rollout_async/publish_s", "rollout_async/version"]
    engine = _section(page, "## In-process vLLM CPU engine")
    assert [line.split("`")[1] for line in engine.splitlines() if line.startswith("* ")] == [
        "rollout/vllm_generate_s", "rollout/vllm_sync_s", "rollout/vllm_async_wait_s"]
    assert "`step_time - vllm_generate_s - vllm_sync_s` is the trainer's own share" in engine.replace("\n", " ")


def test_metrics_page_reads_the_length_edges_from_the_code(monkeypatch):
    """The page's length slices are ``correction.layout.DEFAULT_LENGTH_BUCKETS`` when it renders: other edges give
    another page (so ``tests/unit/test_docs.py`` reports the committed one as stale)."""
    from pathlib import Path

    from trl_rollout_corr.correction import layout

    intro = docgen_pages.metrics_page().split("\n\n")[2].replace("\n", " ")
    assert layout.DEFAULT_LENGTH_BUCKETS == (64, 256, 1024)
    assert ("a length slice (the trainer's edges 64, 256, 1024 valid tokens per row, `DEFAULT_LENGTH_BUCKETS`: "
            "`len_0_64`, `len_64_256`, `len_256_1024`, `len_1024_inf`)") in intro
    monkeypatch.setattr(layout, "DEFAULT_LENGTH_BUCKETS", (32, 512))
    intro = docgen_pages.metrics_page().split("\n\n")[2].replace("\n", " ")
    assert ("a length slice (the trainer's edges 32, 512 valid tokens per row, `DEFAULT_LENGTH_BUCKETS`: "
            "`len_0_32`, `len_32_512`, `len_512_inf`)") in intro
    assert "64" not in intro
    root = Path(__file__).resolve().parents[2]
    assert docgen_pages.stale_pages(root) == ["docs/reference/metrics.md"]


def test_pages_do_not_depend_on_a_parser_having_run():
    """``HfArgumentParser`` rewrites ``Field.type`` in place (``Optional[str]`` -> ``str``); the pages read the
    classes' annotations, so they are the same before and after a parser was built (the staleness check in
    ``tests/unit/test_docs.py`` must not depend on test order)."""
    from transformers import HfArgumentParser

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    before = {rel: render() for rel, render in docgen_pages.GENERATED_PAGES.items()}
    HfArgumentParser(RolloutCorrGRPOConfig)
    assert {rel: render() for rel, render in docgen_pages.GENERATED_PAGES.items()} == before
    assert "* `rollout_rs_on`: type `Optional[str]`, default `None` (core default `'direct'`)" in before[
        "docs/reference/trainer-fields.md"]
