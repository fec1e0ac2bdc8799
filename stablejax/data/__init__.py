"""Data: preparing corpora (:mod:`.prepare`), tokenizers (:mod:`.tokenizer`) and the trainer's
data pipeline (:mod:`.pipeline`: sources, filtering, mixing, batches, the Grain iterator)."""
