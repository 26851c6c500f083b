"""Every setting and its default; the default's type is the setting's type."""

DEFAULTS: dict[str, object] = {
    "port": 8080,
    "workers": 4,
    "debug": False,
    "log_level": "info",
    "db_url": "sqlite:///orders.db",
    "request_timeout": 30,
}
