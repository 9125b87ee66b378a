"""Router settings for tests written by field name: ``router_config(min_cluster_size=3, explore_rate=0.0)``
puts each field in the section of :class:`config.RouterConfig` that declares it, so that a test
names what it sets without spelling out the nesting (a name no section declares is an error)."""

from __future__ import annotations

from config import RouterConfig


def router_config(**settings) -> RouterConfig:
    top: dict = {}
    sections: dict = {}
    for name, value in settings.items():
        home = RouterConfig.section_of(name)
        if home is not None:
            sections.setdefault(home, {})[name] = value
        elif name in RouterConfig.model_fields:
            top[name] = value
        else:
            raise TypeError(f"no section of RouterConfig declares {name!r}")
    return RouterConfig(**top, **sections)
