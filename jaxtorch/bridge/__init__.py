"""The bridge between torch values and JAX values: tensor subclass, interpreter, conversions, API."""
