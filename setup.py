"""Build the optional C merge loop of the BPE trainer (metadata lives in pyproject.toml).

``pip install -e .`` compiles ``torchtitan_ext/tokenizer/_native.c`` (the merge loop) and
``_pretok.c`` (the GPT-2 pre-tokenizer + counter); if no C compiler is available the build is
skipped (``optional=True``) and the trainer uses its pure-Python engine and the ``regex``
package, which give identical merges, only slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "torchtitan_ext.tokenizer._native",
            sources=["torchtitan_ext/tokenizer/_native.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        ),
        Extension(
            "torchtitan_ext.tokenizer._pretok",
            sources=["torchtitan_ext/tokenizer/_pretok.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        ),
    ]
)
