"""Model-side library code: the cross-entropy with z-loss and the outlier-safe model utilities.

Public names are exported from :mod:`stablejax`: ``cross_entropy_with_z_loss`` (:mod:`.losses`),
``init_new_token_embeddings``, ``lambda_warmup``, ``excess_kurtosis``, ``merge_emb_proj``,
``quantize_weights_rtn`` (:mod:`.utils`).
"""
