"""Asynchronous generation's end of run (``AsyncGeneration.end_batch``), brute force: a re-implementation of
transformers 5.x's training loop (``_inner_training_loop`` / ``_run_epoch``: epochs of ``L`` micro-steps with a short
last optimizer step, ``max_steps`` also from ``num_train_epochs``, the resumed epoch's skip, ``DefaultFlowCallback``'s
stop) and of TRL 1.16's generation cadence (``_prepare_inputs``: ``_step % generate_every == 0``, ``_step`` from 0 on
resume) drives the real ``LookAheadLoader``, ``AsyncGeneration`` and ``AsyncRolloutPipeline`` (a fake, instant
engine) over every small configuration and resume step. Each run must train without hanging or raising (unless the
resume is refused: inside a generation batch), generate exactly the batches TRL trains at the rule's versions, and
publish exactly the versions they need.

The loop's arithmetic is checked against the real ``transformers.Trainer`` separately (``test_loop_matches_trainer``,
a plain model: the optimizer steps at which each micro-step trains, with resumes at, and past, ``max_steps``).
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import sys
import types

import pytest
import torch
from transformers import TrainerCallback

from trl_rollout_corr import async_generation, trl_compat
from trl_rollout_corr.engines.async_pipeline import AsyncRolloutPipeline


def transformers_loop(L: int, GA: int, args_max_steps: int, num_train_epochs: float, resume: int, stream=None):
    """transformers 5.x's loop over a loader of ``L`` items (``None``: an iterable dataset, epochs of ``max_steps *
    GA``; ``stream``: it yields only that many items a pass, then runs out: ``get_batch_samples`` returns fewer, the
    pass's last ``stream % GA`` items join the next pass's first optimizer step, and a pass yielding nothing stops
    training): ``(max_steps, epochs)``, each epoch ``(epoch, skipped, [(global_step at each micro-step, whether it
    ends an optimizer step)])`` as ``set_initial_training_values`` / ``_init_training_state`` / ``_run_epoch`` /
    ``DefaultFlowCallback.on_step_end`` run it after a resume at optimizer step ``resume``."""
    if L is None:  # passes over the stream until max_steps (set_initial_training_values: sys.maxsize epochs)
        max_steps, nupe, epochs, per_epoch = args_max_steps, args_max_steps, sys.maxsize, args_max_steps * GA
    else:
        nupe, per_epoch = max(L // GA + int(L % GA > 0), 1), L
        if args_max_steps > 0:
            max_steps = args_max_steps
            epochs = max_steps // nupe + int(max_steps % nupe > 0)
        else:
            max_steps, epochs = math.ceil(num_train_epochs * nupe), math.ceil(num_train_epochs)
    global_step, out = resume, []
    first_epoch, skipped = resume // nupe, (resume % nupe) * GA
    remainder = per_epoch % GA or GA
    for epoch in range(first_epoch, epochs):
        if epoch > first_epoch + max_steps + 1:  # a stream shorter than GA: no pass ends an optimizer step, endless
            return max_steps, out
        skip = skipped if epoch == first_epoch else 0
        step, items, done = skip - 1, iter(range(skip, per_epoch if stream is None else min(stream, per_epoch))), []
        for update_step in range(skip // GA, nupe):
            for _ in itertools.islice(items, GA if update_step != nupe - 1 else remainder):
                step += 1
                sync = (step + 1) % GA == 0 or (step + 1) == per_epoch
                done.append((global_step, sync))
                if sync:
                    global_step += 1
                    if global_step >= max_steps:
                        out.append((epoch, skip, done))
                        return max_steps, out
        out.append((epoch, skip, done))
        if step < 0:  # "There seems not to be a single sample in your epoch_iterator": should_training_stop
            return max_steps, out
    return max_steps, out


class _Engine:
    """Serves every request at once with the version loaded; records batch -> version."""

    timeout_s = 1.0
    pid = None

    def __init__(self, *args, **kwargs):
        self.record, self.version = {}, None

    def start(self):
        pass

    def snapshot(self, model):
        return {}

    def load(self, version, state):
        self.version = version

    def generate(self, batch, prompts, seeds):
        self.record[batch] = self.version
        return [[0]] * len(prompts), [[0.0]] * len(prompts), self.version

    def log_tail(self):
        return ""

    def close(self):
        pass


class _Loader:
    """An epoch of ``L`` dataloader items (one row each, its prompt the item's micro-step counted over epochs); ``L``
    None: an endless stream, restarted each epoch, or (``stream``) one of that many items a pass."""

    def __init__(self, L, skip=0, stream=None):
        self.L, self.skip, self.epoch, self.stream = L, skip, 0, stream

    def __len__(self):
        if self.L is None:
            raise TypeError("an iterable dataset")
        return self.L

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        start = self.epoch * (self.L or self.stream or 0)
        items = range(self.skip, self.L or self.stream) if self.L or self.stream else itertools.count(self.skip)
        return iter([{"prompt": [start + i]}] for i in items)


def _no_save(path):
    pass


def _trainer(tmp_path, GA, spg, num_iterations, depth):
    """What ``AsyncGeneration`` reads of the trainer (the model is never saved: ``TemporaryDirectory`` is faked)."""
    args = types.SimpleNamespace(
        rollout_async_depth=depth, steps_per_generation=spg, gradient_accumulation_steps=GA, output_dir=str(tmp_path),
        ignore_data_skip=False, rollout_async_timeout_s=5.0, temperature=1.0, max_completion_length=1,
        rollout_async_engine_threads=1, seed=0)
    trainer = types.SimpleNamespace(
        args=args, num_iterations=num_iterations, use_vllm=False, eos_token_ids=(0,), _step=0, callbacks=[],
        state=types.SimpleNamespace(global_step=0, max_steps=-1), model=types.SimpleNamespace(),
        accelerator=types.SimpleNamespace(unwrap_model=lambda m: types.SimpleNamespace(save_pretrained=_no_save)),
        trl_metric=lambda name, value: None, _tokenize_prompts=lambda prompts: (prompts, None, None))
    trainer.add_callback = trainer.callbacks.append
    return trainer


def _skip_first_batches(loader, n):
    return _Loader(loader.L, n, loader.stream)


def drive(tmp_path, *, L, GA, spg, num_iterations, depth, max_steps, num_train_epochs=None, resume=0, stream=None):
    """One run through the real look-ahead and pipeline: ``(generated, gen)`` with ``generated`` the batches TRL
    generates (TRL's ``_prepare_inputs``), or None when the resume is refused (``resume_micro_step``)."""
    trainer = _trainer(tmp_path, GA, spg, num_iterations, depth)
    gen = async_generation.AsyncGeneration(trainer)
    publisher = trainer.callbacks[0]
    loader = gen.start(_Loader(L, stream=stream))
    every = spg * num_iterations
    max_steps, epochs = transformers_loop(L, GA, max_steps, num_train_epochs, resume, stream)
    state = trainer.state
    state.global_step, state.max_steps = resume, max_steps
    try:
        publisher.on_train_begin(trainer.args, state, None)
    except ValueError as err:
        assert "inside a generation batch" in str(err)
        return None
    generated = []
    try:
        for epoch, skip, done in epochs:
            epoch_loader = loader.skip_first(skip, _skip_first_batches) if skip else loader
            epoch_loader.set_epoch(epoch)
            items = iter(epoch_loader)
            for global_step, sync in done:
                item = next(items)
                assert state.global_step == global_step
                if trainer._step % every == 0 or not generated:  # TRL's _prepare_inputs (buffer None on resume)
                    gen.take([row["prompt"] for row in item])  # checks the prompts, the step and the micro-step
                    generated.append(gen._taken)
                trainer._step += 1
                if sync:
                    state.global_step += 1
                    publisher.on_step_end(trainer.args, state, None)
    finally:
        gen.close()
    return generated, gen


@pytest.fixture
def published(monkeypatch):
    """The fake engine in place of the transformers engine; returns the versions the trainer publishes."""
    monkeypatch.setattr(async_generation, "check_async_trainer", lambda trainer: None)
    monkeypatch.setattr(async_generation, "TransformersProcessEngine", _Engine)
    monkeypatch.setattr(async_generation.tempfile, "TemporaryDirectory",  # nothing is saved: no folder
                        lambda prefix: types.SimpleNamespace(name=prefix, cleanup=lambda: None))
    versions = []
    publish = AsyncRolloutPipeline.publish
    monkeypatch.setattr(AsyncRolloutPipeline, "publish",
                        lambda self, version, state: (versions.append(version), publish(self, version, state)))
    return versions


def _check(tmp_path, published, **case) -> str:
    published.clear()
    out = drive(tmp_path, **case)
    if out is None:
        return "refused"
    generated, gen = out
    every = case["spg"] * case["num_iterations"]
    resume = case.get("resume", 0)
    first = trl_compat.micro_steps_at(resume, case["GA"], case["L"]) // every
    assert generated == list(range(first, first + len(generated))), case
    assert sorted(gen.engine.record) == generated, case  # exactly the batches TRL trains, none past the end
    assert all(gen.engine.record[j] == gen.batch_version(j) for j in generated), case
    # the version the run starts with, then exactly the versions a trained batch needs
    assert published == sorted({resume} | {gen.batch_version(j) for j in generated}), case
    if generated:
        assert gen.end_batch == generated[-1] + 1, case
    return "trained" if generated else "nothing to train"


def test_end_of_run_brute_force(tmp_path, published):
    """Every small configuration, from the start and resumed at every optimizer step up to one epoch past the end:
    epochs of L = k * generate_every micro-steps (TRL's RepeatSampler), GA not dividing L, max_steps smaller than d
    or past an epoch, fractional num_train_epochs, an iterable dataset (L None)."""
    seen = collections.Counter()
    for GA, spg, num_iterations, depth in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2), (1, 3)):
        every = spg * num_iterations
        for L in (every, 2 * every, 3 * every, None):
            per_epoch = -(-(L or 1) // GA)
            runs = [dict(max_steps=m) for m in (1, 2, per_epoch + 1, 2 * per_epoch + 1)]
            if L is not None:
                runs += [dict(max_steps=-1, num_train_epochs=e) for e in (0.5, 1, 1.5, 2)]
            for run in runs:
                last = transformers_loop(L, GA, run["max_steps"], run.get("num_train_epochs"), 0)[0]
                for resume in range(0, last + per_epoch + 1):
                    case = dict(L=L, GA=GA, spg=spg, num_iterations=num_iterations, depth=depth, resume=resume, **run)
                    seen[_check(tmp_path, published, **case)] += 1
    assert seen["trained"] > 1000 and seen["refused"] and seen["nothing to train"], seen


def _trains_past_pass(GA, stream, epochs) -> bool:
    """Whether the loop trains a pass's last ``stream % GA`` items (they join the next pass's first optimizer step)."""
    full = stream - stream % GA
    return any(skip + k >= full for _, skip, done in epochs for k in range(len(done)))


def test_finite_stream(tmp_path, published):
    """A finite iterable dataset (no length), passes of k generation batches (TRL's ``repeat_iterable_dataset`` drops
    a partial one): a pass not a multiple of GA whose last items the run trains is refused as the look-ahead reaches
    the pass's end (ValueError naming the fix, not the look-ahead's step check mid-run); every other run trains as an
    endless stream does, from the start and resumed at every step (transformers skips the resumed epoch's items, also
    past a pass: that epoch then yields nothing and the next starts the stream again)."""
    seen = collections.Counter()
    for GA, spg, num_iterations, depth in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2), (1, 3)):
        every = spg * num_iterations
        for stream in (every, 2 * every, 3 * every):
            per_pass = -(-stream // GA)
            for max_steps in (1, 2, per_pass, per_pass + 1, 2 * per_pass + 1):
                for resume in range(0, max_steps + 2):
                    case = dict(L=None, GA=GA, spg=spg, num_iterations=num_iterations, depth=depth, resume=resume,
                                max_steps=max_steps, stream=stream)
                    epochs = transformers_loop(None, GA, max_steps, None, resume, stream)[1]
                    refused = stream % GA and _trains_past_pass(GA, stream, epochs)
                    try:
                        result = _check(tmp_path, published, **case)
                    except ValueError as err:
                        assert refused and "finite iterable dataset" in str(err), (case, err)
                        assert f"pass of {stream} dataloader items" in str(err), (case, err)
                        result = "refused: pass"
                    else:  # or the resume is refused first (inside a generation batch)
                        assert not refused or result == "refused", (case, epochs)
                    seen[result] += 1
    assert seen["trained"] > 1000 and seen["refused: pass"] > 100 and seen["refused"], seen


def test_finite_stream_refused_example(tmp_path, published):
    """The reviewer's case: 3 items a pass (spg 1), GA 2, max_steps 3: refused when the look-ahead reaches the end of
    the first pass, before step 1 (items 2, 0, 1) is trained; with max_steps 1 the run stops at step 1 (items 0, 1)
    and trains."""
    with pytest.raises(ValueError, match=r"pass of 3 dataloader items .* gradient_accumulation_steps=2: transformers "
                                         r"trains its last 1 .*map-style datasets.Dataset"):
        drive(tmp_path, L=None, GA=2, spg=1, num_iterations=1, depth=1, max_steps=3, stream=3)
    assert drive(tmp_path, L=None, GA=2, spg=1, num_iterations=1, depth=1, max_steps=1, stream=3)[0] == [0, 1]


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x=None, **kwargs):
        return {"loss": (self.w * x.float()).sum() * 0}


class _Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([i])}


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n=None):
        self.n = n

    def __iter__(self):
        return ({"x": torch.tensor([i])} for i in (itertools.count() if self.n is None else range(self.n)))


def _real_loop(L, GA, max_steps, num_train_epochs, out, resume=None, save=False, stream=None):
    """The real ``transformers.Trainer`` over ``L`` items in order (None: a stream, endless or of ``stream`` items a
    pass): per micro-step ``(global_step, max_steps, item)``."""
    from transformers import Trainer, TrainingArguments

    class Recording(Trainer):
        def _get_train_sampler(self, dataset=None):
            return None if L is None else torch.utils.data.SequentialSampler(self.train_dataset)

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen.append((self.state.global_step, self.state.max_steps, int(inputs["x"][0])))
            return super().training_step(model, inputs, num_items_in_batch)

    args = TrainingArguments(out, per_device_train_batch_size=1, gradient_accumulation_steps=GA, max_steps=max_steps,
                             num_train_epochs=num_train_epochs or 1, save_strategy="steps" if save else "no",
                             save_steps=1, report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True,
                             learning_rate=0.0)
    trainer = Recording(model=_Model(), args=args, train_dataset=_Stream(stream) if L is None else _Items(L))
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer.seen


def test_loop_matches_trainer(tmp_path):
    """``transformers_loop`` is transformers' own loop: the optimizer step and the item of every micro-step, from the
    start and resumed from every checkpoint of a longer run (at, and past, ``max_steps``), epochs with a short last
    step (L = 5 items, GA = 2) and GA past the epoch (L = 3, GA = 4), ``max_steps`` and fractional epochs, and a
    finite stream of 3 items a pass with GA = 2 (step 1 trains items 2, 0, 1: the pass's last item and the next
    pass's first two)."""
    for L, GA, max_steps, epochs, stream in ((5, 2, 4, None, None), (5, 2, -1, 1.5, None), (3, 4, 2, None, None),
                                             (None, 2, 3, None, None), (None, 2, 3, None, 3)):
        saved = str(tmp_path / f"{L}_{GA}_{max_steps}_{stream}")
        _real_loop(L, GA, 6, None, saved, save=True, stream=stream)  # checkpoints 1..6
        for resume in range(0, 7):
            real = _real_loop(L, GA, max_steps, epochs, saved + "_run", stream=stream,
                              resume=os.path.join(saved, f"checkpoint-{resume}") if resume else None)
            last, ours = transformers_loop(L, GA, max_steps, epochs, resume, stream)
            expected = [(step, last, skip + k) for _, skip, done in ours for k, (step, _) in enumerate(done)]
            assert real == expected, (L, GA, max_steps, epochs, resume, stream)
            if stream and not resume:
                assert [item for step, _, item in real if step == 1] == [2, 0, 1]


def test_trl_finite_iterable_dataset_refused(llama_dir, tmp_path, make_args):
    """TRL 1.16 itself feeds such a pass: a ``datasets.IterableDataset`` of 3 prompts goes through
    ``repeat_iterable_dataset`` (1 prompt x 4 generations per generation batch, steps_per_generation 1: a pass of 3
    dataloader items), with GA 2 and max_steps 3 transformers would train its third item with the next pass's first
    two. The tiny Llama's run is refused when the look-ahead reaches the pass's end, before optimizer step 1 ends
    (step 0 trains items 0 and 1), and leaves no engine behind."""
    from tiny_model import prompt_dataset, reward_len
    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    args = make_args(tmp_path, rollout_async_depth=1, rollout_async_timeout_s=60.0, gradient_accumulation_steps=2,
                     steps_per_generation=1, max_steps=3)
    trainer = RolloutCorrGRPOTrainer(model=llama_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(3).to_iterable_dataset())
    pids = []
    trainer.add_callback(_OnStepEnd(lambda: pids.append(trainer.rollout_async.engine_pid)))
    with pytest.raises(ValueError, match=r"finite iterable dataset whose pass of 3 dataloader items .* "
                                         r"gradient_accumulation_steps=2"):
        trainer.train()
    assert trainer.state.global_step == 1 and len(pids) == 1
    assert trainer.rollout_async.pipeline is None and trainer.rollout_async.engine.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


class _OnStepEnd(TrainerCallback):
    def __init__(self, action):
        self.action = action

    def on_step_end(self, args, state, control, **kwargs):
        self.action()
