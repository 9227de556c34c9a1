"""Builds jaxtorch's one C++ piece, the device guard (`jaxtorch/bridge/_device_guard.cpp`), at install time.

Everything else is in pyproject.toml. The build needs torch's headers, so pyproject.toml lists
torch among the build requirements (pip installs it into its isolated build environment from
the same place as the runtime one; with `--no-build-isolation` the installed torch is used).
The extension is optional: without a C++ compiler the install still succeeds, and
`import jaxtorch` then tries once more (printing one line) before falling back to the Python guard.
"""

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "jaxtorch.bridge._device_guard",
            ["jaxtorch/bridge/_device_guard.cpp"],
            define_macros=[("JAXTORCH_TORCH_VERSION", torch.__version__)],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
