"""torchtitan model modules shipped with torchtitan_ext.

Each sub-package follows torchtitan's own model layout (``model_registry(flavor)`` in the
package, config functions in ``config_registry``) and is selected in a train TOML by its short
name, e.g. ``[model] module = "qwen3_vl"`` (``torchtitan_ext.config`` resolves the short name).
"""
