"""The daemon's log format, set once per process (the daemon's, and its KV events process)."""

from __future__ import annotations

import json
import logging


def setup_logging(level: str, fmt: str) -> None:
    if fmt == "json":
        class JsonFormatter(logging.Formatter):
            def format(self, record: logging.LogRecord) -> str:
                return json.dumps({"ts": self.formatTime(record), "level": record.levelname,
                                   "logger": record.name, "msg": record.getMessage()})
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level.upper(), force=True,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
