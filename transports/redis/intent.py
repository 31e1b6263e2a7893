"""How an intent is opened or voided: one server-side script, batched with its neighbours.

A call's intent is written while the engine works on it, by every captured call. As a
WATCH transaction it took two round trips and a pooled connection of its own; as a script
(``INTENT_SCRIPT``) it decides and writes atomically, never loses a race, and the intents
ready at once share one round trip and one durability wait (``ScriptBatch``), as puts do.
Voiding a call with no pending intent is a no-op (frozen or not), a frozen rollout refuses
the rest, and an intent already in that state is left as it is; else the intent is set and
the version advances, and only then is the batch's durability wait checked.
"""

from __future__ import annotations

import hashlib

from transports.redis import keys as k

# KEYS[1]: the rollout hash. ARGV: the intent's field, the entry's field, the value to set
# (keys.INTENT_OPEN or INTENT_VOID). Lua's false is a missing field. The reply is one word:
# "stored" (written, to be made durable), "same" (nothing to write) or "frozen".
INTENT_SCRIPT = f"""
local key, intent, entry, value = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local state = redis.call('HMGET', key, '{k.VERSION}', '{k.FROZEN}', intent, entry)
local version, frozen, current, stored = state[1], state[2], state[3], state[4]
local pending = current == '{k.INTENT_OPEN.decode()}' and not stored
if value == '{k.INTENT_VOID.decode()}' and not pending then return 'same' end
if frozen == '1' then return 'frozen' end
if current == value then return 'same' end
redis.call('HSET', key, intent, value, '{k.VERSION}', (tonumber(version) or 0) + 1)
return 'stored'
"""
INTENT_SHA = hashlib.sha1(INTENT_SCRIPT.encode()).hexdigest()


def intent_args(model_call_id: str, value: bytes) -> tuple[str, str, bytes]:
    """The script's arguments for setting the call's intent to ``value``."""
    return k.field(k.INTENT, model_call_id), k.field(k.ENTRY, model_call_id), value
