"""mlx-vlm's model classes for a config, as mlx-vlm's own loader builds them."""

from __future__ import annotations

from typing import Any

from mlx import nn


def vlm_model(config: dict[str, Any]) -> nn.Module:
    """An mlx-vlm ``Model`` for ``config`` (an mlx-vlm ``config.json``), with random
    (lazy, never evaluated unless used) weights. Raises ValueError for a type mlx-vlm
    does not implement."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    module, _ = get_model_and_args(config)
    config = dict(config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision"])
    return module.Model(model_config)
