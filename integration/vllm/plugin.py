"""The vLLM general plugin (entry point ``vllm.general_plugins``): ``additional_config={"vtoken": ...}``
turns vtoken on, with nothing else to configure.

vLLM loads general plugins in every process before it builds its config (``EngineArgs.__post_init__``,
vllm 0.32 ``engine/arg_utils.py``). ``register`` wraps ``EngineArgs.create_engine_config`` so that, when
the vtoken block is present, the settings are validated, vtoken's KV connector is installed (with the
scheduler and worker classes that wire it to vLLM's scheduler and model runner), and the
finished config is checked against what vtoken has verified (``compat``) -- all before any model loads.
Without the block, vLLM runs exactly as if vtoken were not installed.
"""

from __future__ import annotations

from .compat import UnsupportedConfigError
from .settings import VTokenSettings

CONNECTOR = "VTokenConnector"
CONNECTOR_MODULE = "vtoken.integration.vllm.connector"
SCHEDULER_CLS = f"{CONNECTOR_MODULE}.VTokenScheduler"  # = connector.SCHEDULER_CLS (not imported at config time)
WORKER_CLS = f"{CONNECTOR_MODULE}.VTokenCPUWorker"  # = connector.WORKER_CLS


def register() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "vtoken_wrapped", False):
        return  # plugins may be loaded several times per process

    def create_engine_config(self, *args, **kwargs):
        settings = VTokenSettings.from_additional_config(self.additional_config)
        if settings is not None:
            install_connector(self)
        config = original(self, *args, **kwargs)
        if settings is not None:
            from . import compat
            compat.check(config)
        return config

    create_engine_config.vtoken_wrapped = True
    EngineArgs.create_engine_config = create_engine_config
    from vllm.platforms import current_platform
    if current_platform.is_cpu():  # the gather read path's backend (stock unless an engine selects it)
        from . import gather_backend
        gather_backend.register()


def install_connector(engine_args) -> None:
    from vllm.config import KVTransferConfig

    current = engine_args.kv_transfer_config
    if current is not None and getattr(current, "kv_connector", None) != CONNECTOR:
        raise UnsupportedConfigError(f"vtoken runs as vLLM's KV connector; remove --kv-transfer-config "
                                     f"(found connector {getattr(current, 'kv_connector', current)!r})")
    engine_args.kv_transfer_config = KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE,
                                                      kv_role="kv_both")
    # the connector reaches vLLM's scheduler and model runner through two thin subclasses of vLLM's own classes,
    # which hand themselves to it (connector.py, "Wiring"); the worker's only on CPU, the one verified platform
    from vllm.platforms import current_platform

    wiring = [("scheduler_cls", SCHEDULER_CLS)] + ([("worker_cls", WORKER_CLS)] if current_platform.is_cpu() else [])
    for key, ours in wiring:
        found = getattr(engine_args, key)
        if found not in (None, "auto", ours):
            raise UnsupportedConfigError(f"vtoken installs its own {key} ({ours}, a subclass of vLLM's) to reach "
                                         f"vLLM's scheduler and model runner; remove --{key.replace('_', '-')} "
                                         f"(found {found!r})")
        setattr(engine_args, key, ours)
