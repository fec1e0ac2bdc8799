"""What each axis of a parameter is: Flax metadata first, shapes second, names last.

The floor below both :mod:`stablejax.muon` (which matrix Muon orthogonalises) and
:mod:`stablejax.transforms` (which heads QK-clip rescales): :mod:`stablejax.layout.analysis`
reads a parameter tree once, from its parameters (:mod:`stablejax.layout.leaves`), what their
names say (:mod:`stablejax.layout.names`), which axes of each kernel make its matrix
(:mod:`stablejax.layout.orientation`) and which kernels make an attention layer
(:mod:`stablejax.layout.attention`); :mod:`stablejax.layout.heads` finds each attention layer's
query and key heads in it.
"""
