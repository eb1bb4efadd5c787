#!/usr/bin/env python3
"""What any online eviction order can reach on a multiturn.py trace.

Regenerates the trace with multiturn.py's random draws (same N and SEED),
checks it against TRACE, and replays it at conversation granularity: a
conversation's cached pages are a prefix of its prompt, a continuation hits
the cached part of its earlier prompt (every request also hits the shared
system block), and eviction trims the tail of the conversation the order
puts last. That is the page-level simulator (`tierkv sim`) with whole
conversations in place of pages, which leaf-first orders evict together.

Orders:
  lru          last request of the conversation
  birth        when the conversation began (reads refresh nothing)
  birth-pen    birth, moved back 143 births per continuation (a continued
               conversation has left with probability 0.3 each time)
  slru-S       segmented LRU, continued conversations protected up to a
               share S of the capacity
  birth+oracle birth, and conversations that have left go first: the
               generator's whole state, so an upper bound for any order
               that does not see the future

Usage: multiturn_ceiling.py TRACE [N SEED [CAPACITIES]]
  e.g. multiturn_ceiling.py data/multiturn_trace.jsonl 8000 1 0.05,0.1,0.25,0.5
"""
import heapq, json, random, sys
from collections import OrderedDict

PAGE = 64      # tokens a page, as tierkv sim and replay use
SYSTEM = 8     # whole pages of the shared 512-token system block


def generate(n, seed):
    """multiturn.py's loop, also noting after which request each conversation left."""
    rng = random.Random(seed)
    next_id, live, t, out, left = 1, [], 0, [], {}
    for i in range(n):
        t += int(rng.expovariate(1 / 290.0))
        if live and rng.random() < 0.39:
            idx = len(live) - 1 - min(int(rng.expovariate(1 / 400.0)), len(live) - 1)
            conv = live[idx]
            conv[1] += int(rng.lognormvariate(6.6, 0.8))
            need = (conv[1] + 511) // 512
            while len(conv[0]) < need:
                conv[0].append(next_id); next_id += 1
            blocks, tokens = list(conv[0]), conv[1]
            if rng.random() < 0.3:
                live.pop(idx); left[blocks[1]] = i
        else:
            tokens = max(513, int(rng.lognormvariate(8.8, 0.9)))
            nb = (tokens + 511) // 512
            blocks = [0] + list(range(next_id, next_id + nb - 1)); next_id += nb - 1
            live.append([list(blocks), tokens])
            if len(live) > 4000:
                left[live.pop(0)[0][1]] = i
        rng.lognormvariate(5.8, 0.6)  # output_length, drawn to stay in step
        out.append((tokens, blocks))
    return out, left


def requests(trace):
    """(conversation id, prompt tokens) per request; the id is its first own block."""
    return [(blocks[1], tokens) for tokens, blocks in trace]


def run_scored(reqs, cap, score):
    """Evicts from the conversation with the lowest score(state, request index)."""
    conv, heap, used, hit, births = {}, [], SYSTEM, 0, 0
    for t, (k, tokens) in enumerate(reqs):
        usable = (tokens - 1) // PAGE
        hit += min(SYSTEM, usable) * PAGE
        s = conv.get(k)
        if s is None:
            s = conv[k] = {"key": k, "cached": 0, "birth": births, "conts": 0, "last": t, "ver": 0}
            births += 1
        else:
            hit += max(0, min(s["cached"], usable - SYSTEM)) * PAGE
            s["conts"] += 1
            s["last"] = t
        new = max(tokens // PAGE - SYSTEM, 0)
        used += new - s["cached"]
        s["cached"] = new
        s["ver"] += 1
        heapq.heappush(heap, (score(s, t), s["ver"], k))
        while used > cap:
            _, ver, victim = heap[0]
            v = conv[victim]
            if v["ver"] != ver or v["cached"] == 0:
                heapq.heappop(heap)
                continue
            drop = min(v["cached"], used - cap)
            v["cached"] -= drop
            used -= drop
    return hit


def run_slru(reqs, cap, share):
    probation, protected = OrderedDict(), OrderedDict()  # oldest first
    used, used_protected, hit = SYSTEM, 0, 0
    for k, tokens in reqs:
        usable = (tokens - 1) // PAGE
        hit += min(SYSTEM, usable) * PAGE
        cached = probation.pop(k, None)
        if cached is None and k in protected:
            cached = protected.pop(k)
            used_protected -= cached
        new = max(tokens // PAGE - SYSTEM, 0)
        if cached is None:
            probation[k] = new
        else:
            hit += max(0, min(cached, usable - SYSTEM)) * PAGE
            used -= cached
            protected[k] = new
            used_protected += new
        used += new
        while used > cap:
            if not probation or (protected and used_protected > share * cap):
                _, c = protected.popitem(last=False)
                used_protected -= c
            else:
                _, c = probation.popitem(last=False)
            used -= c
    return hit


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    shares = [float(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "0.05,0.1,0.25,0.5").split(",")]
    trace, left = generate(n, seed)
    with open(sys.argv[1]) as f:
        given = [(r["input_length"], r["hash_ids"]) for r in map(json.loads, f)]
    if given != trace:
        sys.exit(f"{sys.argv[1]} is not multiturn.py {n} {seed}")
    reqs = requests(trace)
    total = sum(t for _, t in reqs)
    pages = SYSTEM + sum(max(t // PAGE - SYSTEM, 0) for t in {k: t for k, t in reqs}.values())
    orders = {
        "lru": lambda s, t: s["last"],
        "birth": lambda s, t: s["birth"],
        "birth-pen": lambda s, t: s["birth"] - 143 * s["conts"],
        "slru-0.2": 0.2,
        "slru-0.5": 0.5,
        "birth+oracle": lambda s, t: s["birth"] - (1 << 40 if left.get(s["key"], n) <= t else 0),
    }
    births, turns, back = {}, {}, []
    for k, _ in reqs:
        if k in births:
            turns[k] += 1
            back.append(len(births) - 1 - births[k])
        else:
            births[k], turns[k] = len(births), 0
    once = sum(1 for v in turns.values() if v >= 1)
    twice = sum(1 for v in turns.values() if v >= 2)
    back.sort()
    print(f"{len(births)} conversations, {len(back)} continuations; {100 * once / len(births):.0f} % ever "
          f"continued, {100 * twice / max(once, 1):.0f} % of those again; a continuation reaches back "
          f"{back[len(back) // 2] if back else 0} newer conversations (median)")
    print(f"{len(reqs)} requests, {pages} pages written; hit rate of prompt tokens")
    print("capacity " + "".join(f"{name:>13}" for name in orders))
    for share in shares:
        cap = int(share * pages)
        row = []
        for order in orders.values():
            hit = run_slru(reqs, cap, order) if isinstance(order, float) else run_scored(reqs, cap, order)
            row.append(f"{100 * hit / total:12.1f}%")
        print(f"{100 * share:6.0f} % " + "".join(row))


if __name__ == "__main__":
    main()
