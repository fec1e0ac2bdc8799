"""Data: the trainer's data (:mod:`.config`, :mod:`.sources`, :mod:`.pipeline`, :mod:`.identity`),
the prepared format (:mod:`.prepared`), preparing corpora (:mod:`.prepare`, with :mod:`.inputs`,
:mod:`.encode`, :mod:`.workers`, :mod:`.tokenizer_choice`, :mod:`.out_dir`), tokenizers
(:mod:`.tokenizer`) and one writer per folder (:mod:`.folder`)."""
