"""A stand-in for `orjson` (not packaged by Debian 12) as far as mini_lb.py and FastAPI's
ORJSONResponse use it: loads, dumps (bytes) and two option flags. Not part of ferry."""

import json as _json

OPT_NON_STR_KEYS = 1 << 0
OPT_SERIALIZE_NUMPY = 1 << 1


def loads(data):
    return _json.loads(data)


def dumps(obj, default=None, option=None) -> bytes:
    return _json.dumps(obj, default=default, separators=(",", ":")).encode()
