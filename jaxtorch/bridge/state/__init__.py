"""Layer 4 of the bridge: module state.

Binding other tensors into a torch module by identity and restoring it as found, the
holders of a compiled train step's state, convolution layouts, named scopes and mesh axes.
"""
