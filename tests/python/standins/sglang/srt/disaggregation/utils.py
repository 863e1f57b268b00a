"""sglang.srt.disaggregation.utils, as far as mini_lb uses it: the body of POST /register."""

from typing import Optional

from pydantic import BaseModel


class PDRegistryRequest(BaseModel):
    mode: str
    registry_url: str
    bootstrap_port: Optional[int] = None
