"""`specserve serve`: run the app under uvicorn until Ctrl-C or until the engine stops."""

from __future__ import annotations

import logging

import uvicorn

from specserve.config import ServerConfig
from specserve.engine.engine import LLMEngine
from specserve.server.app import build_app

logger = logging.getLogger("specserve.server")


def serve(engine: LLMEngine, config: ServerConfig, log_level: str = "info") -> int:
    """Serve until stopped; returns the process exit code: 0 after Ctrl-C, 1 when the engine
    failed (so that a supervisor restarts the server)."""
    server: uvicorn.Server | None = None

    def stop() -> None:         # on the engine thread; uvicorn polls the flag
        if server is not None:
            server.should_exit = True
    app = build_app(engine, config, on_fatal=stop)
    if config.host_names() is None and config.allowed_hosts is None:
        logger.warning("bound to all interfaces: any Host header is answered; pass "
                       "--allowed-hosts to name this server's hosts")
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=log_level))
    try:
        server.run()
    except KeyboardInterrupt:       # uvicorn re-raises Ctrl-C after its clean shutdown
        pass
    if app.state.async_engine.error is not None:
        logger.error("exiting with status 1: %s", app.state.async_engine.why_dead)
        return 1
    return 0
