"""Lua scripts of the index. Each runs atomically inside Redis, so one call is one round trip.

Scripts build worker/blk key names from the ``pd:{m}:`` prefix they are given; every such key
shares the ``{m}`` hash tag with the declared keys, so all of them live in one Cluster slot.
"""

from __future__ import annotations

# Longest cached prefix per live worker, and how much of it sits in the slower tiers.
# KEYS[1] registry; ARGV[1] worker key prefix, ARGV[2] role or '', ARGV[3] blk key prefix,
# ARGV[4] the chain's hashes as one hex string (32 hex digits per block, in chain order),
# ARGV[5] wblocks key prefix, ARGV[6] wtier key prefix or '' to skip counting tiers. (Passing one
# string instead of 256 arguments matters: packing arguments costs the Python client more than
# the whole lookup costs Redis.)
# Returns {id1, n1, host1, disk1, id2, ...} for every live worker of the role: n = leading blocks
# it holds in any tier, host/disk = how many of those n have host/disk as their best tier (0 when
# tiers are skipped).
#
# A worker is live iff its record exists. The chain's first block is read from its blk hash and
# only entries whose generation equals the record's count; the rest of the chain is checked
# per candidate with one SMISMEMBER on its wblocks set, which holds exactly the hashes whose blk
# entry carries the worker's current generation (see APPLY_EVENTS and REGISTER). So a miss
# costs one HGETALL, and a hit one call per worker holding the first block, not one per block.
# Tiers cost one EXISTS per holder, and one HMGET per 1024 matched blocks only for a holder with
# blocks off device; wtier is of the current generation like wblocks, so it needs no fencing.
LONGEST_PREFIX = """
local gen, order = {}, {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  local rec = redis.call('HMGET', ARGV[1] .. id, 'generation', 'role')
  if rec[1] and (ARGV[2] == '' or rec[2] == ARGV[2]) then
    gen[id] = rec[1]
    order[#order + 1] = id
  end
end
local held = {}
local hexes = ARGV[4]
local num_blocks = #hexes / 32
if num_blocks > 0 and #order > 0 then
  local entries = redis.call('HGETALL', ARGV[3] .. string.sub(hexes, 1, 32))
  local candidates = {}
  for j = 1, #entries, 2 do
    if gen[entries[j]] == entries[j + 1] then
      candidates[#candidates + 1] = entries[j]
      held[entries[j]] = 1
    end
  end
  if #candidates > 0 and num_blocks > 1 then
    local rest = {}
    for i = 2, num_blocks do
      rest[i - 1] = string.sub(hexes, 32 * i - 31, 32 * i)
    end
    for _, id in ipairs(candidates) do
      -- Probe in growing chunks (16, 32, ... 1024): a short match costs one small call, a
      -- long one a few calls, and no unpack exceeds Lua's stack.
      local from, size = 1, 16
      while from <= #rest do
        local to = math.min(from + size - 1, #rest)
        local flags = redis.call('SMISMEMBER', ARGV[5] .. id, unpack(rest, from, to))
        local k = 1
        while k <= #flags and flags[k] == 1 do
          k = k + 1
        end
        held[id] = held[id] + k - 1
        if k <= #flags then
          break
        end
        from, size = to + 1, math.min(size * 2, 1024)
      end
    end
  end
end
local out = {}
for _, id in ipairs(order) do
  local n, host, disk = held[id] or 0, 0, 0
  local wtier = ARGV[6] .. id
  if ARGV[6] ~= '' and n > 0 and redis.call('EXISTS', wtier) == 1 then
    for from = 1, n, 1024 do
      local to = math.min(from + 1023, n)
      local fields = {}
      for i = from, to do
        fields[#fields + 1] = string.sub(hexes, 32 * i - 31, 32 * i)
      end
      local tiers = redis.call('HMGET', wtier, unpack(fields))
      for k = 1, #fields do
        if tiers[k] == '1' then
          host = host + 1
        elseif tiers[k] == '2' then
          disk = disk + 1
        end
      end
    end
  end
  out[#out + 1] = id
  out[#out + 1] = n
  out[#out + 1] = host
  out[#out + 1] = disk
end
return out
"""

# Apply a batch of one worker's best-tier transitions, fenced on its generation: nothing is
# written unless the worker record exists and carries ARGV[3]. This fencing is what keeps
# wblocks:<id> (and wtier:<id>) equal to the blk entries of the id's current generation: an
# expired worker, or an old process of a restarted worker, can no longer write.
# KEYS[1] worker record, KEYS[2] wblocks set, KEYS[3] wtier hash; ARGV[1] blk key prefix,
# ARGV[2] worker id, ARGV[3] generation, then pairs (op, hexes): op '0', '1' or '2' held with that
# best tier (device, host, disk), '-' held in no tier, 'clear' nothing held;
# hexes = concatenated 32-digit hex hashes. Every op sets a state, so replaying a batch is harmless.
# Returns 1 applied, 0 record gone (nothing written), 2 superseded by a newer start.
APPLY_EVENTS = """
local current = redis.call('HGET', KEYS[1], 'generation')
if not current then return 0 end
if current ~= ARGV[3] then return 2 end
local blk_prefix, id, gen = ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV, 2 do
  local op, hexes = ARGV[i], ARGV[i + 1]
  if op == 'clear' then
    for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do
      redis.call('HDEL', blk_prefix .. h, id)
    end
    redis.call('DEL', KEYS[2], KEYS[3])
  else
    local held = op ~= '-'
    local hashes = {}
    for s = 1, #hexes, 32 do
      local h = string.sub(hexes, s, s + 31)
      hashes[#hashes + 1] = h
      if held then
        redis.call('HSET', blk_prefix .. h, id, gen)
      else
        redis.call('HDEL', blk_prefix .. h, id)
      end
    end
    for from = 1, #hashes, 1024 do
      local to = math.min(from + 1023, #hashes)
      redis.call(held and 'SADD' or 'SREM', KEYS[2], unpack(hashes, from, to))
      if op == '1' or op == '2' then
        local fields = {}
        for k = from, to do
          fields[#fields + 1] = hashes[k]
          fields[#fields + 1] = op
        end
        redis.call('HSET', KEYS[3], unpack(fields))
      else
        redis.call('HDEL', KEYS[3], unpack(hashes, from, to))
      end
    end
  end
end
return 1
"""

# Every live worker record. KEYS[1] registry; ARGV[1] worker key prefix.
# Returns {id1, {field, value, ...}, id2, {...}, ...}.
LIVE_WORKERS = """
local out = {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  local rec = redis.call('HGETALL', ARGV[1] .. id)
  if #rec > 0 then
    out[#out + 1] = id
    out[#out + 1] = rec
  end
end
return out
"""

# (Re)register a worker: drop every blk entry this worker id ever published (earlier starts, or
# this start before a resync), then write a fresh record with a TTL and enter it in the registry.
# KEYS[1] registry, KEYS[2] worker record, KEYS[3] wblocks set, KEYS[4] wtier hash;
# ARGV[1] blk key prefix, ARGV[2] worker id, ARGV[3] generation, ARGV[4] ttl ms, ARGV[5..] fields.
REGISTER = """
local members = redis.call('SMEMBERS', KEYS[3])
for _, h in ipairs(members) do
  redis.call('HDEL', ARGV[1] .. h, ARGV[2])
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[2], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return #members
"""

# Keep a record alive and refresh its load. Never recreates a missing record (that would be a
# record without identity fields); the caller re-registers instead.
# KEYS[1] worker record, KEYS[2] compat key; ARGV[1] generation, ARGV[2] ttl ms, ARGV[3..] fields.
# Returns 1 alive, 0 record gone (expired or Redis restarted), 2 superseded by a newer start.
HEARTBEAT = """
local current = redis.call('HGET', KEYS[1], 'generation')
if not current then return 0 end
if current ~= ARGV[1] then return 2 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

# Purge workers whose record expired, at most ARGV[2] blocks per call (so Redis is never
# blocked for long; the caller loops while the first reply element is 1).
# KEYS[1] registry; ARGV[1] key prefix 'pd:{m}:', ARGV[2] block budget.
# Returns {more, id, generation, removed, done, id, ...}: removed counts blk entries deleted
# (only those still holding the dead generation); done = 1 when the worker is fully purged.
# The popped hashes leave wtier:<id> too: a dead worker's id has no newer start (its record
# would exist), so its wtier is the dead generation's.
PURGE_DEAD_WORKERS = """
local prefix = ARGV[1]
local budget = tonumber(ARGV[2])
local out = {0}
local registry = redis.call('HGETALL', KEYS[1])
for i = 1, #registry, 2 do
  local id, gen = registry[i], registry[i + 1]
  if redis.call('EXISTS', prefix .. 'worker:' .. id) == 0 then
    if budget <= 0 then
      out[1] = 1
      break
    end
    local wblocks = prefix .. 'wblocks:' .. id
    local hashes = redis.call('SPOP', wblocks, budget)
    local removed = 0
    for _, h in ipairs(hashes) do
      local blk = prefix .. 'blk:' .. h
      if redis.call('HGET', blk, id) == gen then
        redis.call('HDEL', blk, id)
        removed = removed + 1
      end
    end
    local wtier = prefix .. 'wtier:' .. id
    for from = 1, #hashes, 1024 do
      redis.call('HDEL', wtier, unpack(hashes, from, math.min(from + 1023, #hashes)))
    end
    budget = budget - #hashes
    local done = redis.call('EXISTS', wblocks) == 0
    if done then
      redis.call('DEL', wtier)
      redis.call('HDEL', KEYS[1], id)
    else
      out[1] = 1
    end
    out[#out + 1] = id
    out[#out + 1] = gen
    out[#out + 1] = removed
    out[#out + 1] = done and 1 or 0
    if not done then break end
  end
end
return out
"""

# Orderly leave: drop the worker's entries, record and registry entry, unless a newer start of
# the same worker id has already taken over. KEYS[1] registry, KEYS[2] worker record,
# KEYS[3] wblocks set, KEYS[4] wtier hash; ARGV[1] blk key prefix, ARGV[2] worker id,
# ARGV[3] generation.
# Returns 1 if deregistered, 0 if superseded (nothing touched).
DEREGISTER = """
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[3] then return 0 end
for _, h in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  redis.call('HDEL', ARGV[1] .. h, ARGV[2])
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HDEL', KEYS[1], ARGV[2])
return 1
"""
