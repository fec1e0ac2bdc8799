"""Outlier-safe Muon: Newton-Schulz (XLA reference and Pallas kernels), routing, LR checks.

Public names are exported from :mod:`stablejax`: ``newton_schulz``, ``outlier_safe_muon``,
``OutlierSafeMuonState``, ``GroupUpdateRmsState``, ``label_params``, ``describe_routing``,
``muon_dimension_numbers``, ``check_learning_rates``.
"""
