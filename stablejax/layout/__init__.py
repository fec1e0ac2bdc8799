"""What each axis of a parameter is: Flax metadata first, shapes second, names last.

The floor below both :mod:`stablejax.muon` (which matrix Muon orthogonalises) and
:mod:`stablejax.transforms` (which heads QK-clip rescales): :mod:`stablejax.layout.analysis`
reads a parameter tree once, :mod:`stablejax.layout.heads` finds the attention layers and their
heads in it.
"""
