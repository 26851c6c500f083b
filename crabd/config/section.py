"""What every section of crabd's configuration shares, and the limits sections and the daemon both use."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

#: Most stdout + stderr one command's result may carry: the gRPC message
#: limit (80 MiB, crabd/daemon/app.py and the SDK) less room for the rest.
MAX_REPLY_OUTPUT = 64 << 20
#: Docker refuses memory limits below this.
MIN_MEMORY = 6 << 20


class Section(BaseModel):
    """One section (table) of crabd.toml."""

    # TOML has `nan` and `inf`; no setting of crabd means anything with them
    # (an infinite maximum would pass every bound check).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
