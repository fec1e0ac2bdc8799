"""prepare's tokenizer: the one named, or a BPE trained on the corpus, and how workers load it.

``bytes``, ``gpt2`` (tiktoken) and a ``tokenizer.json`` path are loaded before anything is
written (`checked_tokenizer`), so an unknown name, a missing file or a needed download fails
early. ``bpe:N`` is trained (`make_tokenizer`) with Hugging Face ``tokenizers`` on the training
split of all inputs (the documents :func:`stablejax.data.encode.classify` keeps for training, up
to ``--bpe-train-bytes``). A ``tokenizer.json`` goes into ``--out`` with the corpus (read in place
when it is already ``--out``'s own). The worker processes load the tokenizer again from its spec:
``("name", NAME, None)`` or ``("file", PATH, EOT_TOKEN)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterator, Optional

from tqdm import tqdm

from stablejax.data import tokenizer as tokenizer_lib
from stablejax.data.config import Options, PrepareError
from stablejax.data.encode import as_text, classify
from stablejax.data.inputs import iter_documents
from stablejax.data.out_dir import PARTIAL
from stablejax.data.prepared import TOKENIZER_FILE, write_error, writing

_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")


def checked_tokenizer(spec: str, eot_token: Optional[str]
                      ) -> tuple[Optional[int], Optional[tokenizer_lib.Tokenizer]]:
  """(N of bpe:N, None) or (None, the loaded tokenizer); loaded before anything is written, so an
  unknown name, a missing file or a needed download fails early."""
  try:
    bpe = tokenizer_lib.parse_bpe_size(spec)
    return (bpe, None) if bpe is not None else (None, tokenizer_lib.get_tokenizer(spec, eot_token))
  except tokenizer_lib.TokenizerError as e:
    raise PrepareError(str(e)) from None


def make_tokenizer(spec: str, bpe_size: Optional[int],
                   given_tok: Optional[tokenizer_lib.Tokenizer], in_place: bool,
                   inputs: list[str], out: Path, opts: Options,
                   bpe_train_bytes: Optional[int], progress: bool, log: Callable[[str], object],
                   partials: dict[str, str], check_stop: Callable[[], None]
                   ) -> tuple[tokenizer_lib.Tokenizer, tuple]:
  """(the tokenizer, the spec workers load it from): ``given_tok`` (its tokenizer.json copied
  to this run's partial file in ``out``, unless ``in_place``), or a BPE of ``bpe_size`` trained on
  the training documents of ``inputs`` and saved as that partial file."""
  partial = out / partials.get(TOKENIZER_FILE, TOKENIZER_FILE + PARTIAL)
  if bpe_size is None:
    assert given_tok is not None, "a named tokenizer is loaded before this"
    tok = given_tok
    if isinstance(tok, tokenizer_lib.HFTokenizer):
      if in_place:  # --out's own tokenizer.json: read in place, never rewritten
        return tok, ("file", str(tok.path), tok.eot_token)
      with writing(out / TOKENIZER_FILE):
        partial.write_bytes(tok.path.read_bytes())  # the directory carries its own tokenizer
      return tok, ("file", str(partial), tok.eot_token)
    return tok, ("name", spec, None)
  log(f"training a byte-level BPE of vocabulary {bpe_size} on the training split")
  bar = tqdm(unit="B", unit_scale=True, desc="bpe data", disable=not progress)
  limit = bpe_train_bytes if bpe_train_bytes else float("inf")

  def training_texts() -> Iterator[str]:
    seen = 0
    for entry in inputs:
      for doc in iter_documents(entry, opts):
        check_stop()
        text, raw, _ = as_text(doc)
        if classify(raw, opts) == "train":
          yield text
          seen += len(raw)
          bar.update(len(raw))
          if seen >= limit:
            return

  try:
    tok = tokenizer_lib.train_bpe(training_texts(), bpe_size, partial)
  except (PrepareError, KeyboardInterrupt):
    raise
  except Exception as e:  # noqa: BLE001 - tokenizers reports a failed save as a plain Exception
    code = _OS_ERROR_CODE.search(str(e))
    if code is None:
      raise
    raise write_error(out / TOKENIZER_FILE, OSError(int(code.group(1)), str(e))) from None
  finally:
    bar.close()
  if tok.vocab_size < bpe_size:
    log(f"note: the corpus supports only {tok.vocab_size} BPE tokens, fewer than {bpe_size}")
  return tok, ("file", str(partial), tok.eot_token)
