"""Layer 4 of the bridge: module state.

One mechanism binds other values into torch modules and restores them as found
(`_binding.Binding`: snapshot, bind by identity, restore); on it sit the holders of a
compiled train step's state, the mesh-axes region, and the entry points above. Also here:
moving modules across the jax device keeping their Parameter objects (`_moves`),
convolution layouts and named scopes.

`import jaxtorch` installs the module moves (`Module.to("jax")`, `.cpu()`, `.to_empty`:
`_moves.install_module_moves`, called by `jaxtorch._install`).
"""
