"""Shared fixtures: tiny local models (no Hub access) and the trainer factories used by the trainer tests; the tiers.

The tiers are directories (issue 48): a test file sits in ``tests/unit/``, ``tests/features/``, ``tests/trainer/`` or
``tests/e2e/`` (``TIERS``), and every test in it gets that directory's marker here (``pytest_collection_modifyitems``),
so ``pytest -m trainer`` selects ``tests/trainer/``. No file sets a tier marker itself; ``tests/unit/test_layout.py``
fails when a test file sits outside a tier directory or a marker contradicts its directory. ``unit`` marks the fast
component tests (pure math, config, losses, TRL formulas, the accumulator, the generate engine on a tiny model; no
training run), so ``pytest -m unit`` selects them: all of ``tests/unit/``, and the tests marked ``unit`` by hand in
the few files of other tiers that ``test_layout.UNIT_MARKED_ELSEWHERE`` lists. ``slow`` and ``vllm`` are not tiers:
a test or a file sets them. Helper modules and subprocess workers are in ``tests/helpers/`` (on ``sys.path``:
``pythonpath`` in pyproject.toml), data files in ``tests/data/``.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

# ATen's kernels are chosen by CPU capability, and AVX-512 kernels round float32 reductions differently from AVX2 in
# the last bits (measured on an AVX-512 AMD EPYC: a golden run's grad norm 27.046466 against 27.046468). The golden
# trainer runs (test_trainer_golden.py) are bit-exact values recorded at the AVX2 kernels, so every test process uses
# them where the CPU has them. Set before torch runs its first kernel; a caller's own ATEN_CPU_CAPABILITY wins.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
# torch.compile's on-disk cache does not key on that capability: kernels cached by a process on other kernels gave
# wrong values here (test_compiled_matches_eager failed after a run without the pin, passed with a fresh cache), so
# the tests keep their own cache per capability.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}"))

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny_model import make_tiny_model_dir, prompt_dataset, reward_len

torch.set_num_threads(1)  # the test machine's cores are shared; every test runs single-threaded


TESTS_DIR = Path(__file__).resolve().parent
# tests/<tier>/ -> the marker every test in it gets (pyproject.toml registers them)
TIERS = ("unit", "features", "trainer", "e2e")


def tier_of(path) -> str | None:
    """The tier of a test file: the first directory under ``tests/`` (``None`` outside a tier directory)."""
    parts = Path(path).resolve().relative_to(TESTS_DIR).parts
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects (pytest's mark plugin, in this same hook)
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (8 experts, top-2; no router aux loss; seed 0; ``tiny_model``), built once per module."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), "qwen3_moe", seed=0)


@pytest.fixture
def _silence_trl_experimental(monkeypatch):
    """TRL warns that ``rollout_func`` (and tools/environments) are experimental; a file that uses them opts in with
    ``pytestmark = pytest.mark.usefixtures("_silence_trl_experimental")``."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A tiny random Llama with its char-level tokenizer, saved locally (seed 0)."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_llama")), "llama", seed=0)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    """A tiny random Qwen2 with its char-level tokenizer, saved locally (seed 1)."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_qwen2")), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tool_dir(tmp_path_factory):
    """A tiny Qwen2 trained to call ``multiply_tool`` through the real ``generate`` (``tool_model``; seconds)."""
    from tool_model import make_tool_model_dir

    return make_tool_model_dir(str(tmp_path_factory.mktemp("tiny_tool_qwen2")))


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """A tiny Mixtral (4 experts, top-2) returning router logits (``feature_models``)."""
    from feature_models import make_tiny_moe_dir

    return make_tiny_moe_dir(str(tmp_path_factory.mktemp("tiny_moe")))


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    """A tiny Llama sequence classifier (one label) to use as a reward model (``feature_models``)."""
    from feature_models import make_tiny_reward_model_dir

    return make_tiny_reward_model_dir(str(tmp_path_factory.mktemp("tiny_reward")))


# The tests' training arguments (a 3-step float32 CPU run on 8 prompts); shared by our config and plain TRL's.
TRAIN_DEFAULTS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    max_steps=3,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    learning_rate=1e-3,
    save_strategy="no",
    beta=0.0,
    seed=0,
    disable_tqdm=True,
    # TRL defaults to bf16 autocast (also on CPU); the tests train in float32 unless they say otherwise
    bf16=False,
)


def _make_args(tmp_path, config_cls=None, **overrides):
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    config_cls = config_cls or RolloutCorrGRPOConfig
    return config_cls(**{"output_dir": str(tmp_path / "out"), **TRAIN_DEFAULTS, **overrides})


def _make_trainer(model_dir, tmp_path, trainer_cls=None, reward_funcs=reward_len, **overrides):
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    trainer_cls = trainer_cls or RolloutCorrGRPOTrainer
    args = _make_args(tmp_path, **overrides)
    return trainer_cls(model=model_dir, reward_funcs=reward_funcs, args=args, train_dataset=prompt_dataset(8))


def _step_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def _loss_inputs(trainer, log_ratio_rows, advantages):
    """A 2-row micro-batch; returns (inputs, pi_theta log-probs, log of the given ratios) with mask
    [[1,1,1],[1,1,0]]."""
    prompt_ids = torch.tensor([[2, 10, 11], [2, 12, 13]])
    completion_ids = torch.tensor([[14, 15, 16], [17, 18, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([torch.ones_like(prompt_ids), completion_mask], 1), 3)
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.tensor(advantages),
                  num_items_in_batch=completion_mask.sum())
    return inputs, logp.float(), torch.tensor(log_ratio_rows).log()


@pytest.fixture
def make_args():
    """``make_args(tmp_path, config_cls=None, **overrides)``: a 3-step float32 CPU ``RolloutCorrGRPOConfig`` (or
    ``config_cls``, e.g. TRL's ``GRPOConfig``)."""
    return _make_args


@pytest.fixture
def make_trainer():
    """``make_trainer(model_dir, tmp_path, trainer_cls=None, reward_funcs=reward_len, **config_overrides)``."""
    return _make_trainer


@pytest.fixture
def step_logs():
    """``step_logs(trainer)``: the training log records (those with a ``loss``)."""
    return _step_logs


@pytest.fixture
def loss_inputs():
    """``loss_inputs(trainer, log_ratio_rows, advantages)``: a hand-made 2-row micro-batch (see ``_loss_inputs``)."""
    return _loss_inputs
