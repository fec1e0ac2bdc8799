"""Hugging Face Flax language models (transformers 4.x) built from small configs, no weights.

Shared by the tests that run stablejax on models it did not write: each builder returns the
``Flax*ForCausalLM`` / ``Flax*LMHeadModel`` object (random init; nothing is downloaded) with a
config of 2 layers and width 32-64, small enough for a few CPU steps.
"""

import transformers

VOCAB = 96
SEQ = 16


def _gpt2(**kwargs):
  cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                initializer_range=0.2)  # logits of order 1, not 1e-2
  return transformers.FlaxGPT2LMHeadModel(cfg, seed=0, **kwargs)


def _gpt_neo(**kwargs):
  cfg = transformers.GPTNeoConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_size=32,
                                  num_layers=2, num_heads=4, attention_types=[[["global"], 2]],
                                  resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0,
                                  initializer_range=0.2)
  return transformers.FlaxGPTNeoForCausalLM(cfg, seed=0, **kwargs)


def _llama(**kwargs):
  cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=SEQ)
  return transformers.FlaxLlamaForCausalLM(cfg, seed=0, **kwargs)


def _mistral(**kwargs):
  cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=SEQ,
                                   sliding_window=SEQ)  # None: Flax keeps the diagonal only
  return transformers.FlaxMistralForCausalLM(cfg, seed=0, **kwargs)


def _gemma(**kwargs):
  cfg = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=8,
                                 max_position_embeddings=SEQ)
  return transformers.FlaxGemmaForCausalLM(cfg, seed=0, **kwargs)


BUILDERS = {"gpt2": _gpt2, "gpt_neo": _gpt_neo, "llama": _llama, "mistral": _mistral,
            "gemma": _gemma}


def build(family: str, **kwargs):
  """The model of ``family`` (a key of ``BUILDERS``); ``kwargs`` go to the model's class
  (``input_shape=`` of the forward pass its init runs; ``_do_init=False``: its
  ``params_shape_tree`` only, nothing initialised)."""
  return BUILDERS[family](**kwargs)
