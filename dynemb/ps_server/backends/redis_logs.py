"""RedisStore's logs: each table's change log and deletion log (streams of packed ids, entries
numbered by the ids logged up to them, so that a cursor counts ids as on the embedded store),
the namespace's log of drops, and the sweeps' lease and last result (layout: redis_keys.py)."""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from dynemb.ps_server.backends import redis_keys as layout
from dynemb.ps_server.backends.id_log import END, parse_cursor
from dynemb.ps_server.backends.redis_keys import StoreParts, _raw, _TableMeta, drops_key
from dynemb.ps_server.change_log import Changes, checked_max_ids, no_change_log
from dynemb.ps_server.errors import Contended
from dynemb.ps_server.lifecycle import Deletions, Drop, Drops


class RedisLogs(StoreParts):
    """The logs of RedisStore's tables and namespace (see the module)."""

    # -- the change log (change_log.py) --------------------------------------------------

    def change_log(self, table: str) -> int:
        """See Store.change_log."""
        return self._row_meta(table).change_log

    def set_change_log(self, table: str, max_ids: int) -> int:
        """See Store.set_change_log: kept in the table's metadata, which every PS reads."""
        max_ids = checked_max_ids(table, max_ids)
        for _ in range(layout.CREATE_TRIES):
            meta = self._meta(table)
            d = json.loads(meta.raw)
            if max_ids:
                d["change_log"] = max_ids
            else:
                d.pop("change_log", None)
            raw = json.dumps(d, sort_keys=True).encode()
            if self._run_scripted(functools.partial(self._mark, [table, meta.raw, raw]))[0]:
                self._tables_changed += 1  # threads' kept metadata is void
                if meta.change_log and not max_ids:  # readers across the time it is off: a gap
                    self._run_scripted(functools.partial(self._skip_log, meta.changes_key))
                if max_ids and not meta.change_log:
                    # a row call of any PS may work from metadata read up to FRESH_METADATA_S ago:
                    # past that, every push logs (a publisher reads its first cursor after this)
                    time.sleep(layout.FRESH_METADATA_S)
                return max_ids
        raise Contended(f"table {table!r} in Redis namespace {self.namespace!r} kept changing; try again")

    def changes(self, table: str, after: str = "", limit: int = 65536) -> Changes:
        """See Store.changes: cursors as the deletion log's (deletions)."""
        meta = self._meta(table)
        if not meta.change_log:
            raise no_change_log(table)
        at = parse_cursor(after, f"table {table!r}", "change log")
        return Changes(*self._read_log(meta.changes_key, at, after, limit))

    def take_sweep_lease(self, table: str, owner: str, seconds: float) -> bool:
        """See Store.take_sweep_lease: a key that expires, set if absent or this owner's."""
        meta = self._meta(table)
        ms = max(1, int(seconds * 1000))
        got = self._run_scripted(lambda pipe: self._script(pipe, _LEASE_LUA, [meta.lease_key], [owner, ms]))[0]
        return bool(int(got))

    def release_sweep_lease(self, table: str, owner: str) -> None:
        """See Store.release_sweep_lease: the key removed if it is still this owner's."""
        meta = self._meta(table)
        self._run_scripted(lambda pipe: self._script(pipe, _RELEASE_LUA, [meta.lease_key], [owner]))

    def drops(self, after: str = "", limit: int = 1000) -> Drops:
        """See Store.drops: entries of the namespace's log of drops, numbered as the drops are
        (_DROP_LUA), so a cursor is a count, as on the embedded store."""
        at = parse_cursor(after, "the log of dropped tables")
        key = drops_key(self.namespace)
        pipe = self._pipeline()
        start = "-" if at is None or at == END else f"({at}-0"
        pipe.execute_command("XRANGE", key, start, "+", "COUNT", max(1, limit))
        pipe.execute_command("XRANGE", key, "-", "+", "COUNT", 1)
        pipe.execute_command("XREVRANGE", key, "+", "-", "COUNT", 1)
        entries, first, last = self._run(pipe)
        end = _last_number(last)
        if at == END or (at is not None and at > end):  # the end now; or a cursor of another log
            return Drops([], str(end), at != END)
        # entry n is the n-th drop: one past `at` missing from the oldest kept means trimmed ones
        gap = at is not None and bool(first) and _number(first[0][0]) > at + 1
        got, cursor = [], after if at is not None else str(end)
        for entry_id, fields in entries:
            values = _entry_fields(fields)
            got.append(Drop(_raw(values[b"table"]).decode(), float(_raw(values[b"t"]))))
            cursor = str(_number(entry_id))
        return Drops(got, cursor, gap)

    def record_sweep(self, table: str, result: dict) -> None:
        """See Store.record_sweep: a key beside the table's, read by every PS."""
        meta = self._meta(table)
        with self._redis():
            self.client.set(meta.swept_key, json.dumps(result, sort_keys=True))

    def last_sweep(self, table: str) -> dict | None:
        """See Store.last_sweep."""
        meta = self._meta(table)
        with self._redis():
            raw = self.client.get(meta.swept_key)
        try:
            return None if raw is None else dict(json.loads(_raw(raw)))
        except (ValueError, TypeError):
            return None

    def _log_deleted(self, meta: _TableMeta, ids) -> None:
        """Append ids to the table's deletion log, before they are deleted (a crash between
        leaves ids logged that are still stored, which a reader checks; never the reverse)."""
        self._log_ids(meta.log_key, ids, layout.LOG_MAX_IDS)

    def _log_ids(self, key: bytes, ids, max_ids: int) -> None:
        """Append ids to the log (a stream) at key, which keeps about its newest max_ids."""
        import numpy as np

        ids = np.ascontiguousarray(ids, dtype="<i8")
        if not len(ids):
            return
        per = layout.LOG_IDS_PER_ENTRY
        chunks = [ids[lo : lo + per].tobytes() for lo in range(0, len(ids), per)]
        for lo in range(0, len(chunks), 64):  # a script of at most 64 entries (256k ids)
            args = [max_ids, *chunks[lo : lo + 64]]
            self._run_scripted(functools.partial(self._append_log, key, args))

    def _run_one(self, *command) -> Any:
        pipe = self._pipeline()
        pipe.execute_command(*command)
        return self._run(pipe)[0]

    def _skip_log(self, key: bytes, pipe) -> None:
        self._script(pipe, _SKIP_LUA, [key], [])

    def _append_log(self, key: bytes, args: list, pipe) -> None:
        self._script(pipe, _LOG_LUA, [key], args)

    def deletions(self, table: str, after: str = "", limit: int = 65536) -> Deletions:
        """See Store.deletions: a cursor is the count of ids logged up to a point (decimal), as
        on the embedded store; the log's entries are numbered so (_LOG_LUA)."""
        meta = self._meta(table)
        at = parse_cursor(after, f"table {table!r}")
        return Deletions(*self._read_log(meta.log_key, at, after, limit))

    def _read_log(self, key: bytes, at: int | None, after: str, limit: int) -> tuple:
        """(ids, times, cursor, gap) of the log (a stream, _LOG_LUA) at key, from cursor `at`."""
        import numpy as np

        if at == END:
            last = self._run_one("XREVRANGE", key, "+", "-", "COUNT", 1)
            end = _last_number(last)
            return np.zeros(0, np.int64), np.zeros(0, np.float64), str(end), False
        pipe = self._pipeline()
        pipe.execute_command("XRANGE", key, "-", "+", "COUNT", 1)
        start = at if at is not None else 0
        # the entries whose ids end within `limit` of the cursor (ids number the ids logged)
        pipe.execute_command("XRANGE", key, f"({start}-0", f"{start + max(1, limit)}-0")
        pipe.execute_command("XRANGE", key, f"({start}-0", "+", "COUNT", 1)
        pipe.execute_command("XREVRANGE", key, "+", "-", "COUNT", 1)
        first, entries, one, last = self._run(pipe)
        if at is None and first:  # from the oldest kept
            oldest = _number(first[0][0]) - len(_entry_fields(first[0][1])[b"ids"]) // 8
            if oldest > start:
                entries = self._run_one("XRANGE", key, f"({oldest}-0", f"{oldest + max(1, limit)}-0")
                one = first
        entries = entries or one  # an entry bigger than the limit comes whole
        gap = False
        end = _last_number(last)
        if at is not None and first:  # where the oldest entry kept starts: past `at`, entries were trimmed
            first_end = _number(first[0][0])
            gap = first_end - len(_entry_fields(first[0][1])[b"ids"]) // 8 > at
        ids: list[np.ndarray] = []
        times: list[np.ndarray] = []
        cursor = after if at is not None else str(end)
        if at is not None and at > end:  # a cursor of another log (the table made again)
            gap, cursor, entries = True, str(end), []
        running = at
        for entry_id, fields in entries:
            values = _entry_fields(fields)
            part = np.frombuffer(_raw(values[b"ids"]), dtype="<i8").astype(np.int64)
            number = _number(entry_id)
            if running is not None and number - len(part) > running:  # a count skipped (_SKIP_LUA)
                if ids:
                    break
                gap = True
            running = number
            cursor = str(number)
            ids.append(part)
            times.append(np.full(len(part), float(_raw(values[b"t"]))))
        return (
            np.concatenate(ids) if ids else np.zeros(0, np.int64),
            np.concatenate(times) if times else np.zeros(0, np.float64),
            cursor,
            gap,
        )


def _number(entry_id) -> int:
    """A log entry's number: its stream id "<n>-0" (_LOG_LUA, _DROP_LUA)."""
    return int(_raw(entry_id).split(b"-")[0])


def _last_number(reply: list) -> int:
    """The number of the entry an XREVRANGE ... COUNT 1 gave (0: the log is empty)."""
    return _number(reply[0][0]) if reply else 0


def _entry_fields(fields) -> dict:
    """A stream entry's fields as a dict (redis-py gives a dict or a flat list)."""
    return fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2]))


# KEYS[1] a deletion log (stream): an entry per ARGV[2...] (packed ids), the log then trimmed to
# about its newest ARGV[1] ids (MINID: whole entries, whole stream nodes); each entry's id is
# "<ids logged up to it>-0", so a reader's cursor counts ids as on the embedded store, the bound
# is in ids whatever the entries' sizes, and a reader finds out whether ids past its cursor were
# trimmed.
_LOG_LUA = (
    "local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1) local n = 0 "
    "if #last > 0 then n = tonumber(string.match(last[1][1], '^(%d+)')) end "
    "local t = redis.call('TIME') local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2])) "
    "for i = 2, #ARGV do n = n + #ARGV[i] / 8 "
    "redis.call('XADD', KEYS[1], n .. '-0', 'ids', ARGV[i], 't', now) end "
    "if n > tonumber(ARGV[1]) then redis.call('XTRIM', KEYS[1], 'MINID', '~', (n - tonumber(ARGV[1])) .. '-0') end "
    "return n"
)


# KEYS[1] a log (stream, _LOG_LUA): an entry of no ids numbered one past the last, which tells a
# reader that reads across it that ids were not logged there (a change log turned off).
_SKIP_LUA = (
    "local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1) local n = 0 "
    "if #last > 0 then n = tonumber(string.match(last[1][1], '^(%d+)')) end "
    "local t = redis.call('TIME') "
    "redis.call('XADD', KEYS[1], (n + 1) .. '-0', 'ids', '', 't', t[1]) return n + 1"
)


# KEYS[1] the lease: set to ARGV[1] for ARGV[2] ms if absent or ARGV[1]'s already (1), else 0.
_LEASE_LUA = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v == false or v == ARGV[1] then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end return 0"
)


# KEYS[1] the lease: removed if it is ARGV[1]'s (1), else left to its holder (0).
_RELEASE_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
