"""KV-cache generation against full recomputation, sampling rules, and the sample CLI."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablejax.training.trained.decoding import Generator, greedy_reference, sample_logits
from stablejax.modeling.gpt import GPT, ModelConfig
from helpers import (assert_unusable_path_is_one_line, gpt_params, once_per_config,
                     unusable_path_cases)

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=32,
            compute_dtype="float32", init_std=0.2, qk_norm=False)
VARIANTS = {
    "scan": {},
    "unscanned_qknorm_tied": dict(scan_layers=False, qk_norm=True, tie_embeddings=True),
    "ssnorm_embproj_remat": dict(norm="ssnorm", emb_proj=True, remat=True),
}


@once_per_config
def init(cfg: ModelConfig, seed: int = 1):
  """The parameters of ``cfg`` (initialised once per config and seed in this module: each
  initialisation is a program to compile)."""
  return gpt_params(cfg, seed=seed)


@once_per_config
def cached_generator(cfg: ModelConfig) -> Generator:
  """One KV-cache ``Generator(cfg)`` (no top-k, every id) per config in this module: a Generator
  jits its own segment, so each new one compiles every prompt and segment shape again."""
  return Generator(cfg)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_kv_cache_equals_full_recomputation(variant):
  cfg = ModelConfig(**{**BASE, **VARIANTS[variant]})
  params = init(cfg)
  prompt = [3, 5, 7, 11, 13]
  ref_tokens, ref_logits = greedy_reference(cfg, params, prompt, 20)
  got = Generator(cfg).generate(params, prompt, 20, temperature=0.0)[0].tolist()
  assert got == ref_tokens
  assert len(set(ref_tokens)) > 2  # a model that repeats one token would prove little
  # Logits of each cached step equal the full forward pass at that position.
  model = GPT(cfg)
  prefill = jax.jit(lambda p, t: model.apply({"params": p}, t, decode=True, mutable=["cache"]))
  step = jax.jit(lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True,
                                             mutable=["cache"]))
  logits, variables = prefill(params, jnp.asarray([prompt]))
  np.testing.assert_allclose(logits[0, -1], ref_logits[0], rtol=1e-4, atol=1e-4)
  cache = variables["cache"]
  for i, token in enumerate(ref_tokens[:-1]):
    logits, variables = step(params, cache, jnp.asarray([[token]]))
    cache = variables["cache"]
    np.testing.assert_allclose(logits[0, -1], ref_logits[i + 1], rtol=1e-4, atol=1e-4)


def test_sampling_is_deterministic_for_a_seed():
  cfg = ModelConfig(**BASE)
  params = init(cfg)
  gen = Generator(cfg, top_k=10)
  a = gen.generate(params, [1, 2, 3], 24, temperature=0.8, seed=7, num_samples=3)
  b = Generator(cfg, top_k=10).generate(params, [1, 2, 3], 24, temperature=0.8, seed=7,
                                        num_samples=3)
  c = gen.generate(params, [1, 2, 3], 24, temperature=0.8, seed=8, num_samples=3)
  assert a.shape == (3, 24) and a.dtype == np.int32
  assert np.array_equal(a, b)
  assert not np.array_equal(a, c)
  assert not np.array_equal(a[0], a[1])  # samples of one call differ from each other


def test_top_k_1_is_greedy_and_padding_ids_are_never_drawn():
  cfg = ModelConfig(**BASE)
  params = init(cfg)
  greedy = cached_generator(cfg).generate(params, [4, 9], 16, temperature=0.0)
  top1 = Generator(cfg, top_k=1).generate(params, [4, 9], 16, temperature=1.5, seed=3)
  assert np.array_equal(greedy, top1)
  # W - 1 = 31 tokens: one segment (one program); the padding rule is sample_logits' for every
  # segment alike.
  drawn = Generator(cfg, valid_vocab=10).generate(params, [4, 9], cfg.max_seq_len - 1,
                                                  temperature=5.0, seed=0, num_samples=4)
  assert drawn.max() < 10 and len(np.unique(drawn)) > 3


def test_sample_logits_top_k_matches_numpy():
  logits = jax.random.normal(jax.random.key(0), (1, 50))
  allowed = set(np.argsort(-np.asarray(logits[0]))[:5].tolist())
  drawn = {int(sample_logits(logits, jax.random.key(i), 1.0, 5, 50)[0]) for i in range(200)}
  assert drawn <= allowed and len(drawn) >= 3


def test_sample_logits_draws_from_the_softmax_of_logits_over_temperature() -> None:
  # The module docstring: "logits / temperature". Two ids with logits 0 and 1: id 1 is drawn
  # with probability 1 / (1 + exp(-1 / T)), 0.982 at T = 0.25 and 0.562 at T = 4.
  n = 4000
  logits = jnp.tile(jnp.array([[0.0, 1.0]]), (n, 1))
  for temperature in (0.25, 4.0):
    drawn = np.asarray(sample_logits(logits, jax.random.key(1), jnp.float32(temperature), 0, 2))
    want = 1 / (1 + np.exp(-1 / temperature))
    assert abs(drawn.mean() - want) < 0.03, (temperature, drawn.mean(), want)


SHORT = dict(BASE, max_seq_len=8, n_layers=1)  # a short window: every prompt length is cheap


def test_greedy_kv_cache_uses_the_whole_window_for_every_prompt_length():
  # While prompt + generated tokens fit in the window W, the cached decoder must give what full
  # recomputation gives: for a P-token prompt that is W - P + 1 tokens, the last one drawn from a
  # context of exactly W tokens (P = W: one token from the full window).
  cfg = ModelConfig(**SHORT)
  window = cfg.max_seq_len
  params = init(cfg)
  gen = cached_generator(cfg)
  rng = np.random.default_rng(0)
  for length in range(1, window + 1):
    prompt = rng.integers(1, cfg.vocab_size, size=length).tolist()
    n_new = window - length + 1
    # Full recomputation (within the window, the windowed reference's context is the whole
    # sequence): one jitted forward pass for every length, not a new program per call.
    want = windowed_reference(cfg, params, prompt, n_new)
    got = gen.generate(params, prompt, n_new, temperature=0.0)[0].tolist()
    assert got == want, f"prompt length {length}"


@once_per_config
def _forward(cfg):
  """One jitted forward pass per model config, so the reference compiles once."""
  return jax.jit(GPT(cfg).apply)


def windowed_reference(cfg, params, prompt, n_new):
  """Greedy decoding by full recomputation under the documented policy past the window W: the
  context is the last W tokens of the prompt; once a token would need W + 1 tokens of context,
  it restarts from the last W // 2 tokens and grows again."""
  apply = _forward(cfg)
  window, keep = cfg.max_seq_len, cfg.max_seq_len // 2
  ids = list(prompt)
  start = max(0, len(ids) - window)
  for _ in range(n_new):
    if len(ids) - start > window:
      start = len(ids) - keep
    context = ids[start:]
    padded = np.zeros((1, window), np.int32)
    padded[0, :len(context)] = context
    logits = np.asarray(apply({"params": params}, jnp.asarray(padded)))[0, len(context) - 1]
    ids.append(int(np.argmax(logits)))
  return ids[len(prompt):]


@pytest.mark.parametrize("length", [1, 7, 8, 20])
def test_generation_past_the_context_window_follows_the_stated_policy(length):
  cfg = ModelConfig(**SHORT)
  params = init(cfg)
  prompt = np.random.default_rng(length).integers(1, cfg.vocab_size, size=length).tolist()
  n_new = 3 * cfg.max_seq_len + 5  # several re-prefills
  got = cached_generator(cfg).generate(params, prompt, n_new, temperature=0.0)[0].tolist()
  assert got == windowed_reference(cfg, params, prompt, n_new)
  assert len(set(got)) > 2


def test_sample_cli_errors(tmp_path, capsys):
  from stablejax.cli import sample as sample_cli
  from stablejax.training.trained import run as trained_run
  assert sample_cli.main([str(tmp_path / "missing")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "does not exist" in err[0]
  assert sample_cli.main([str(tmp_path), "--top-k", "-1"]) == 2
  (tmp_path / "config.json").write_text('{"data": {"train": "x.bin"}}')
  from stablejax.training.config import load_config
  with pytest.raises(trained_run.RunError, match="--tokenizer"):
    trained_run.run_tokenizer(load_config(tmp_path / "config.json"))


@pytest.fixture(scope="module")
def bpe_run_home(tmp_path_factory):
  """A folder with corpus.txt, its prepared BPE directory `data` and a 6-step `run` trained on
  it with data.train given as the relative path "data" (a test that changes it works on a
  copy)."""
  import os

  from stablejax.cli import prepare as prepare_cli

  from helpers import run_inprocess
  home = tmp_path_factory.mktemp("bpe_run") / "home"
  home.mkdir()
  docs = [f"Document {i}: the quick brown fox jumps over the lazy dog {i % 7} times." * 3
          for i in range(80)]
  (home / "corpus.txt").write_text("<|endoftext|>".join(docs))
  cwd = os.getcwd()
  os.chdir(home)
  try:
    assert prepare_cli.main(["corpus.txt", "--out", "data", "--tokenizer", "bpe:300",
                             "--val-fraction", "0.2", "--no-progress"]) == 0
    # (the tiny runs' warm-up of 4 steps: the step is the one test_prepare's BPE runs compile)
    assert run_inprocess(home / "run", "data.train=data", "train.steps=6", "train.eval_every=6",
                         "checkpoint.every=6") == 0
  finally:
    os.chdir(cwd)
  return home


@pytest.mark.slow
def test_a_run_carries_its_tokenizer_and_sample_never_switches_silently(tmp_path, monkeypatch,
                                                                      capsys, bpe_run_home):
  # A run on a prepared BPE directory given as a relative path, sampled from another directory:
  # the data path does not resolve there, so only what the run recorded can decode it.
  import json
  import shutil

  from stablejax.cli import sample as sample_cli
  from stablejax.training.trained import run as trained_run
  from stablejax.data import tokenizer as tokenizer_lib
  from stablejax.training.trained import sampling

  from helpers import run_inprocess
  home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
  shutil.copytree(bpe_run_home, home)
  elsewhere.mkdir()
  monkeypatch.chdir(home)
  run = home / "run"
  record = json.loads((run / "tokenizer" / "record.json").read_text())
  original = tokenizer_lib.get_tokenizer(str(home / "data" / "tokenizer.json"))
  assert record["kind"] == "hf" and record["sha256"] == original.sha256
  assert (run / "tokenizer" / "tokenizer.json").read_bytes() == \
      (home / "data" / "tokenizer.json").read_bytes()

  monkeypatch.chdir(elsewhere)
  got = sampling.sample(run, "Document 1", max_new_tokens=8, temperature=0.0)
  ids = original.encode("Document 1")
  assert got["prompt_ids"] == ids  # encoded with the run's BPE, not bytes
  assert got["samples"][0] == "Document 1" + original.decode(ids + got["tokens"][0])[
      len(original.decode(ids)):]

  def cli(*args):
    capsys.readouterr()
    code = sample_cli.main([str(run), "--prompt", "Document 1", "--max-new-tokens", "4",
                            "--temperature", "0", *args])
    return code, [line for line in capsys.readouterr().err.splitlines()
                  if line.startswith("error:")]

  copy = run / "tokenizer" / "tokenizer.json"
  saved = copy.read_bytes()
  copy.write_bytes(saved + b" ")  # changed (still a loadable tokenizer.json)
  code, errors = cli()
  assert code == 2 and len(errors) == 1 and str(copy) in errors[0] and "--tokenizer" in errors[0]
  copy.unlink()  # missing
  code, errors = cli()
  assert code == 2 and len(errors) == 1 and "is missing" in errors[0] and "--tokenizer" in errors[0]
  code, errors = cli("--tokenizer", "bytes")  # not the recorded one
  assert code == 2 and len(errors) == 1
  assert "not the tokenizer the run was trained with" in errors[0]
  assert cli("--tokenizer", str(home / "data" / "tokenizer.json")) == (0, [])
  # A run from before tokenizer records: its relative data path does not resolve from here.
  shutil.rmtree(run / "tokenizer")
  code, errors = cli()
  assert code == 2 and len(errors) == 1 and "'data'" in errors[0] and "--tokenizer" in errors[0]
  monkeypatch.chdir(home)
  assert cli() == (0, [])  # from where it was started, it still works
  assert trained_run.read_tokenizer_record(run) is None

  # Resuming the run on data of another tokenizer is refused (it would train on other ids).
  assert run_inprocess(run, "data.train=data", "train.steps=8", "train.eval_every=6",
                       "checkpoint.every=6", fresh=False) == 0
  assert trained_run.read_tokenizer_record(run)["sha256"] == original.sha256  # recorded on resume
  capsys.readouterr()
  assert run_inprocess(run, "data.train=corpus.txt", "model.vocab_size=320", "train.steps=10",
                       fresh=False) == 2
  err = capsys.readouterr().err
  assert "is not the one this run was trained with" in err and "--fresh" in err


@pytest.mark.slow
def test_sampling_a_run_again_in_one_process_reuses_its_generator(bpe_run_home, monkeypatch):
  # A second sample() of the same model calls the programs the first compiled: one Generator
  # (one jitted decoder) for the same config, top_k and vocabulary; another top_k, or a model
  # family registered since, builds its own.
  import collections

  from stablejax.training.trained import decoding, sampling
  from stablejax.transforms import _registry

  built = []

  class CountingGenerator(decoding.Generator):
    def __init__(self, *args, **kwargs):
      built.append(kwargs)
      super().__init__(*args, **kwargs)

  monkeypatch.setattr(decoding, "Generator", CountingGenerator)
  monkeypatch.setattr(sampling, "_GENERATORS", collections.OrderedDict())
  run, tokenizer = bpe_run_home / "run", str(bpe_run_home / "data" / "tokenizer.json")

  def sample(**kwargs):
    return sampling.sample(run, "Document 1", max_new_tokens=3, tokenizer=tokenizer, **kwargs)

  first, again = sample(seed=0), sample(seed=0)
  sample(seed=1)
  assert len(built) == 1 and first["tokens"] == again["tokens"]
  sample(top_k=3)
  assert len(built) == 2 and built[-1]["top_k"] == 3
  generation = _registry.generation()
  monkeypatch.setattr(_registry, "generation", lambda: generation + 1)  # a plugin loaded since
  sample(seed=0)
  assert len(built) == 3


@pytest.mark.slow
@pytest.mark.parametrize("signal_name,delay", [("SIGINT", 0.3), ("SIGTERM", 1.0),
                                               ("SIGINT", 2.0)])
def test_a_stop_signal_while_sample_compiles_is_one_line_never_a_crash(
    tmp_path, bpe_run_home, signal_name, delay):
  """The signal comes a moment after the run's tokenizer is loaded, the last step before the
  decoder is traced and compiled (seconds on a CPU): exit 130 with one line, never a traceback
  or a segfault."""
  import subprocess
  import sys

  from process_hooks import hooked_env
  from helpers import ROOT
  env = hooked_env(tmp_path, HOOK_SIGNAL_AFTER_MODULE="tokenizers",
                   HOOK_DELAY=str(delay), HOOK_SIGNAL=signal_name)
  # The decoder is compiled, not loaded from a compilation cache (a load can end before the
  # latest signal comes): neither the session's nor the user's folder, which an earlier case
  # would have filled.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["STABLEJAX_COMPILATION_CACHE"] = "off"
  proc = subprocess.run([sys.executable, "-m", "stablejax", "sample", str(bpe_run_home / "run"),
                         "--tokenizer", str(bpe_run_home / "data" / "tokenizer.json"),
                         "--max-new-tokens", "64"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
  lines = proc.stderr.strip().splitlines()
  if proc.stdout == "":  # before the samples existed
    assert lines == [f"interrupted by {signal_name}: stopped before the samples were done; "
                     f"nothing was written"], proc.stderr
  else:  # once they exist (the compilation ended with them), they are kept
    assert lines == [f"interrupted by {signal_name}: the samples were done and are printed "
                     f"above; their speed was not measured"], proc.stderr


def test_sample_out_never_writes_the_runs_records(tmp_path, capsys):
  from stablejax.cli import sample as sample_cli
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text('{"data": {"train": "corpus.txt"}}')
  (run / "run.json").write_text("{}")
  (tmp_path / "mine.json").write_text('{"not": "samples"}')
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  for target, needle in ((run / "config.json", "the run's own"),
                         (run / "run.json", "the run's own"),
                         (run / "checkpoints" / "s.json", "the run's own"),
                         (tmp_path / "mine.json", "not written by sample"),
                         (tmp_path, "is a directory"),
                         (tmp_path / "missing" / "s.json", "does not exist")):
    assert sample_cli.main([str(run), "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_stop_once_the_samples_exist_keeps_them(tmp_path, capsys, monkeypatch, bpe_run_home):
  """Ctrl-C during the generation: it finishes (nothing is thrown into it), and then the samples
  are printed and written, not thrown away; only their speed is not measured."""
  import json
  import signal

  from stablejax.cli import _process
  from stablejax.cli import sample as sample_cli
  from stablejax.training.trained.decoding import Generator
  real = Generator.generate

  def generate_then_ctrl_c(self, *args, **kwargs):
    tokens = real(self, *args, **kwargs)
    _process._record(signal.SIGINT, None)  # arrives while the first generation runs
    return tokens

  monkeypatch.setattr(Generator, "generate", generate_then_ctrl_c)
  out = tmp_path / "samples.json"
  code = sample_cli.main([str(bpe_run_home / "run"), "--prompt", "Document 1", "--temperature",
                          "0", "--max-new-tokens", "6", "--tokenizer",
                          str(bpe_run_home / "data" / "tokenizer.json"), "--out", str(out)])
  captured = capsys.readouterr()
  assert code == 130, captured.err
  assert captured.err.strip().splitlines() == [
      f"interrupted by SIGINT: the samples were done and are printed above, and written to "
      f"{out}; their speed was not measured"]
  saved = json.loads(out.read_text())
  assert saved["program"] == "stablejax sample" and captured.out == saved["samples"][0] + "\n"
  assert saved["samples"][0].startswith("Document 1") and len(saved["tokens"][0]) == 6


@pytest.mark.parametrize("args,line", unusable_path_cases("samples.json", "s"))
def test_an_unusable_path_is_one_line(args, line, tmp_path, monkeypatch, capsys):
  from stablejax.cli import sample as sample_cli
  assert_unusable_path_is_one_line(sample_cli.main, args, line, tmp_path, monkeypatch, capsys)


def test_orbaxs_unreadable_checkpoint_metadata_is_one_warning_line(tmp_path, capsys, caplog):
  """Orbax reads a checkpoint's _CHECKPOINT_METADATA, logs through absl that it cannot, and goes
  on without it: the programs that read checkpoints say so in one line, once per file."""
  from orbax.checkpoint._src.metadata.checkpoint import metadata_store

  from stablejax.cli import _process
  _process.quiet_orbax_leftovers()  # (every program reading checkpoints does)
  garbage = tmp_path / "4" / "_CHECKPOINT_METADATA"
  garbage.parent.mkdir()
  garbage.write_text("garbage\n")
  store = metadata_store(enable_write=False)  # as CheckpointManager reads one
  assert store.read(garbage) is None and store.read(garbage) is None  # read twice
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"warning: {garbage} (Orbax's metadata of the checkpoint: when it was saved) "
                 "cannot be read; the checkpoint is read without it"]
  assert not [r for r in caplog.records if r.name == "absl"]


# ----------------------------------------------------------------------------- forward pass only


def _forward_only(cfg):
  """The same GPT as a family that declares nothing but its forward pass (a user's Linen model
  through LinenLanguageModel): no decode_start, so no KV cache."""
  from stablejax.modeling.family import LinenLanguageModel
  return LinenLanguageModel("forward_only", cfg, GPT(cfg))


def test_a_family_without_decoding_samples_by_re_running_the_model():
  from stablejax.training.trained.decoding import RECOMPUTE
  cfg = ModelConfig(**SHORT)
  window = cfg.max_seq_len
  params = init(cfg)
  model = _forward_only(cfg)
  assert not model.supports("decoding")
  gen, cached = Generator(model), cached_generator(cfg)
  assert gen.method == RECOMPUTE and cached.method != RECOMPUTE
  rng = np.random.default_rng(1)
  for length in (1, 5, window):
    prompt = rng.integers(1, cfg.vocab_size, size=length).tolist()
    n_new = window - length + 1  # within the window: the KV cache's tokens
    want = cached.generate(params, prompt, n_new, temperature=0.0)[0].tolist()
    assert gen.generate(params, prompt, n_new, temperature=0.0)[0].tolist() == want
    # Sampled with one seed, the same draws from the same logits.
    np.testing.assert_array_equal(
        gen.generate(params, prompt, n_new, temperature=0.8, seed=3, num_samples=3),
        cached.generate(params, prompt, n_new, temperature=0.8, seed=3, num_samples=3))
  # Past the window, nanoGPT's crop: each token is the argmax of a forward pass over the last W
  # tokens, run here by hand, unpadded (one jitted forward pass: a program per context length,
  # not one per operation and length).
  prompt = [3, 5, 7]
  ids = list(prompt)
  forward = _forward(cfg)
  for _ in range(3 * window):
    context = jnp.asarray([ids[-window:]], jnp.int32)
    ids.append(int(np.argmax(forward({"params": params}, context)[0, -1])))
  got = gen.generate(params, prompt, 3 * window, temperature=0.0)[0].tolist()
  assert got == ids[len(prompt):] and len(set(got)) > 2


def test_the_samples_at_evals_of_a_family_without_decoding_say_so_once_in_the_banner():
  import json
  import types

  import optax

  from stablejax.training.config import load_config, model_of
  from stablejax.training.loop.components import _sampler
  from stablejax.training.run_folder.summary import banner
  from stablejax.training.trained.decoding import RECOMPUTE
  cfg = load_config(None, [f"model.{k}={json.dumps(v)}" for k, v in SHORT.items()
                           if k != "vocab_size"]  # the byte tokenizer's 256
                    + ["train.seq_len=8", "logging.sample_tokens=4"])
  model = _forward_only(cfg.model)
  params = init(cfg.model)
  warned: list = []
  sampler = _sampler(cfg, model, warned.append)
  assert sampler is not None and warned == [] and sampler.gen.method == RECOMPUTE
  text = sampler(params, 0)
  assert text.startswith(cfg.logging.sample_prompt) and len(text) > len(cfg.logging.sample_prompt)
  components = types.SimpleNamespace(
      cfg=cfg, model=model, sampler=sampler, mesh=types.SimpleNamespace(shape={"data": 1}),
      data=types.SimpleNamespace(stats={}), total_steps=10, tx=optax.sgd(0.1))
  budget = types.SimpleNamespace(describe_length=lambda steps: "train.steps")
  lines = banner(components, params, budget, "out", 0)
  assert sum(RECOMPUTE in line for line in lines) == 1
  components.sampler = _sampler(cfg, model_of(cfg), warned.append)  # the KV cache: no line
  assert not any(RECOMPUTE in line for line in banner(components, params, budget, "out", 0))
