"""A finished run read back: its config, parameters and tokenizer (:mod:`.run`), the KV-cache
decoder (:mod:`.decoding`), text from it (:mod:`.sampling`) and its quantised evaluation
(:mod:`.quantized_eval`)."""
