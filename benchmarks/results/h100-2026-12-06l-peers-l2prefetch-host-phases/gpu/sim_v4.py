"""Deadlock check of seesaw v4's barrier protocol (order of waits and arrivals only, no timing)."""
import itertools
LEFT, RIGHT, ROPE = 0, 1, 2
BOXES = {LEFT: range(0, 4), RIGHT: range(4, 8), ROPE: range(8, 9)}
ORDER = [(0, 0), (0, 2), (1, 1), (0, 1), (1, 0), (1, 2)]
def readers(s, p):
    if s == 0: return 2 if p == 1 else 1
    return 1 if p == 1 else 2

def programs(R):
    wg0 = [('wfull', 0, b, 0) for b in range(9)]
    wg1 = [('wfull', 1, b, 0) for b in range(9)]
    for i in range(R):
        last = i == R - 1
        wg0 += [('arrive', 'A', i), ('rel', 0, RIGHT, i), ('sync', 'B', i), ('arrive', 'P0', i),
                ('rel', 0, LEFT, i), ('rel', 0, ROPE, i), ('sync', 'X', i)]
        if not last:
            wg0 += [('wfull', 0, b, i + 1) for b in range(4)]
            wg0 += [('rel', 1, LEFT, i), ('rel', 1, ROPE, i)]
            wg0 += [('wfull', 0, 8, i + 1)] + [('wfull', 0, b, i + 1) for b in range(4, 8)]
        else:
            wg0 += [('rel', 1, LEFT, i), ('rel', 1, ROPE, i)]
        wg1 += [('sync', 'A', i), ('arrive', 'B', i), ('rel', 1, LEFT, i), ('sync', 'P0', i), ('arrive', 'X', i),
                ('rel', 1, RIGHT, i), ('rel', 1, ROPE, i), ('rel', 0, RIGHT, i)]
        if not last:
            wg1 += [('wfull', 1, b, i + 1) for b in list(range(4, 8)) + list(range(4)) + [8]]
    prod = []
    for i in range(R):
        for s, p in ORDER:
            if i > 0:
                prod.append(('wempty', s, p, i - 1))
            prod.append(('copy', s, p, i))
    return {'wg0': wg0, 'wg1': wg1, 'prod': prod}

def blocked(op, full, empty, arrived):
    """Whether `op` waits: its box not landed, its part not released by all its readers, its named barrier not arrived at."""
    k = op[0]
    if k == 'wfull':
        return (op[1], op[2], op[3]) not in full
    if k == 'wempty':
        return empty.get((op[1], op[2], op[3]), 0) < readers(op[1], op[2])
    if k == 'sync':
        return (op[1], op[2]) not in arrived
    return False


def ready_actors(progs, pc, full, empty, arrived):
    """The actors whose next op can run now."""
    return [a for a, prog in progs.items() if pc[a] < len(prog) and not blocked(prog[pc[a]], full, empty, arrived)]


def run(R, order):
    progs = programs(R)
    pc = {k: 0 for k in progs}
    full = set()      # (s, box, round) landed
    empty = {}        # (s, p, round) -> arrivals
    arrived = set()   # (bar, gen)
    steps = 0
    while True:
        moved = False
        for actor in order:
            prog = progs[actor]
            while pc[actor] < len(prog):
                op = prog[pc[actor]]
                kind = op[0]
                if blocked(op, full, empty, arrived): break
                if kind == 'copy':
                    for b in BOXES[op[2]]: full.add((op[1], b, op[3]))
                elif kind == 'rel':
                    empty[(op[1], op[2], op[3])] = empty.get((op[1], op[2], op[3]), 0) + 1
                elif kind == 'arrive':
                    arrived.add((op[1], op[2]))
                pc[actor] += 1
                moved = True
                steps += 1
        if all(pc[a] == len(progs[a]) for a in progs):
            return True, steps
        if not moved:
            return False, {a: (pc[a], progs[a][pc[a]] if pc[a] < len(progs[a]) else None) for a in progs}

import random
def run_random(R, seed):
    rnd = random.Random(seed)
    progs = programs(R)
    pc = {k: 0 for k in progs}
    full = set(); empty = {}; arrived = set(); synced = {}
    while True:
        ready = ready_actors(progs, pc, full, empty, arrived)
        if not ready:
            return all(pc[a] == len(progs[a]) for a in progs)
        actor = rnd.choice(ready)
        op = progs[actor][pc[actor]]; k = op[0]
        if k == 'copy':
            for b in BOXES[op[2]]: full.add((op[1], b, op[3]))
        elif k == 'rel':
            s, p, i = op[1], op[2], op[3]
            # the mbarrier's phase for round i - 1 must be complete before an arrival of round i
            if i > 0: assert empty.get((s, p, i - 1), 0) == readers(s, p), ('early release', op)
            empty[(s, p, i)] = empty.get((s, p, i), 0) + 1
            assert empty[(s, p, i)] <= readers(s, p), ('over-release', op)
        elif k == 'arrive':
            # a named barrier generation must be consumed before the next arrival (bar.arrive reuse)
            if op[2] > 0: assert (op[1], op[2] - 1) in synced, ('named barrier reused early', op)
            arrived.add((op[1], op[2]))
        elif k == 'sync':
            synced[(op[1], op[2])] = True
        pc[actor] += 1


if __name__ == '__main__':
    for R in range(1, 7):
        for order in itertools.permutations(['wg0', 'wg1', 'prod']):
            ok, info = run(R, list(order))
            if not ok:
                print('DEADLOCK', R, order, info); break
        else:
            print('rounds', R, 'no deadlock in any actor order')
    # over-release check: a part must not receive more arrivals than readers in a round

    bad = 0
    for R in range(1, 7):
        for seed in range(3000):
            try:
                if not run_random(R, seed): bad += 1; print('deadlock', R, seed); break
            except AssertionError as e:
                bad += 1; print('violation', R, seed, e); break
    print('random interleavings checked, problems:', bad)
