"""Session ids per API key: a PUT onto an id that another key's session holds stores the session under an alias.

A client may name a session (`PUT /v1/sessions/{id}/state` onto a free id creates it there). Were an id taken by
another key refused, the refusal would tell that the id exists under another key; so the importer's session goes to
`<id>~<tag>`, the tag a hash of its owner: what it stores, reads and deletes as `<id>` is that alias, while the other
key's session is untouched. `~` is outside the ids a client may send (`server.protocol.SESSION_ID_PATTERN`), so no
client can name an alias, and everything a client is shown carries the public id (`public_id`). Stdlib only: the
engine's errors import it.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["SEPARATOR", "alias_of", "is_alias", "public_id"]

SEPARATOR = "~"
_TAG_HEX = 16  # 64 bits: owners are API keys (a few); two of them sharing a tag is not to be expected
_ALIAS = re.compile(rf"(.+){re.escape(SEPARATOR)}[0-9a-f]{{{_TAG_HEX}}}")


def alias_of(session_id: str, owner: str) -> str:
    """Where `owner`'s session of the public id `session_id` is stored when another owner's holds that id."""
    return f"{session_id}{SEPARATOR}{hashlib.sha256(owner.encode('utf-8')).hexdigest()[:_TAG_HEX]}"


def is_alias(session_id: str) -> bool:
    """An alias, or at least no id a client may name a session by."""
    return SEPARATOR in session_id


def public_id(stored_id: str) -> str:
    """The id the session's owner knows it by (any other id as it is)."""
    alias = _ALIAS.fullmatch(stored_id)
    return alias.group(1) if alias else stored_id
