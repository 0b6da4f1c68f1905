"""Buffer hand-overs of seesaw v4: every read of a buffer's round-i contents must come after its
round-i write and before its round-(i+1) write (random interleavings of the two warpgroups and the
producer, waits as in sim_v4)."""
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim_v4 import BOXES, LEFT, ORDER, RIGHT, ROPE, ready_actors
# Buffers: sP0, box8 of stage 0 (P0), box8 of stage 1 (P1, written after the rope copy was read),
# cs0 (c0 slots), cs1 (c1 slots), sM. 'w' = write of round i, 'r0'/'r1' = start / end of a read.
def programs(R):
    wg0 = [('wfull', 0, b, 0) for b in range(9)]
    wg1 = [('wfull', 1, b, 0) for b in range(9)]
    for i in range(R):
        last = i == R - 1
        wg0 += [('w', 'cs0', i), ('w', 'sM', i), ('w', 'box8_0', i),
                ('arrive', 'A', i), ('rel', 0, RIGHT, i),
                ('r0', 'box8_0', i),  # P0 V0 (left) issued
                ('sync', 'B', i), ('r', 'cs1', i), ('r', 'sM', i + 0.5), ('w', 'sP0', i), ('arrive', 'P0', i),
                ('r1', 'box8_0', i),  # wait_group 0: P0 V0 done
                ('rel', 0, LEFT, i), ('rel', 0, ROPE, i), ('sync', 'X', i),
                ('r0', 'box8_1', i)]  # P1 V1 (left) issued
        if not last:
            wg0 += [('wfull', 0, b, i + 1) for b in range(4)]
            wg0 += [('r1', 'box8_1', i), ('rel', 1, LEFT, i), ('rel', 1, ROPE, i)]
            wg0 += [('wfull', 0, 8, i + 1)] + [('wfull', 0, b, i + 1) for b in range(4, 8)]
        else:
            wg0 += [('r1', 'box8_1', i), ('rel', 1, LEFT, i), ('rel', 1, ROPE, i)]
        wg1 += [('sync', 'A', i), ('r', 'cs0', i), ('r', 'sM', i), ('w', 'cs1', i), ('w', 'sM', i + 0.5),
                ('arrive', 'B', i), ('w', 'box8_1', i), ('rel', 1, LEFT, i),
                ('r0', 'box8_1', i),  # P1 V1 (right) issued
                ('sync', 'P0', i), ('r0', 'sP0', i), ('arrive', 'X', i),
                ('r1', 'box8_1', i), ('rel', 1, RIGHT, i), ('rel', 1, ROPE, i),
                ('r1', 'sP0', i), ('rel', 0, RIGHT, i)]
        if not last:
            wg1 += [('wfull', 1, b, i + 1) for b in list(range(4, 8)) + list(range(4)) + [8]]
    prod = []
    for i in range(R):
        for s, p in ORDER:
            if i > 0: prod.append(('wempty', s, p, i - 1))
            prod.append(('copy', s, p, i))
    return {'wg0': wg0, 'wg1': wg1, 'prod': prod}

def run(R, seed):
    rnd = random.Random(seed)
    progs = programs(R); pc = {k: 0 for k in progs}
    full = set(); empty = {}; arrived = set()
    version = {}    # buffer -> round of its current contents
    reading = {}    # (actor, buffer) -> round being read
    while True:
        ready = ready_actors(progs, pc, full, empty, arrived)
        if not ready:
            assert all(pc[a] == len(progs[a]) for a in progs), 'deadlock'
            return
        a = rnd.choice(ready); op = progs[a][pc[a]]; k = op[0]
        if k == 'copy':
            for b in BOXES[op[2]]:
                full.add((op[1], b, op[3]))
                # a copy into box 8 overwrites P of the round before: its readers must be done
                if b == 8:
                    buf = 'box8_%d' % op[1]
                    for (x, bb), r in reading.items():
                        assert bb != buf, ('copy over a read in progress', op, x)
                    version[buf] = ('rope', op[3])
        elif k == 'rel':
            empty[(op[1], op[2], op[3])] = empty.get((op[1], op[2], op[3]), 0) + 1
        elif k == 'arrive':
            arrived.add((op[1], op[2]))
        elif k == 'w':
            buf, i = op[1], op[2]
            for (x, bb), r in reading.items():
                assert bb != buf, ('write over a read in progress', op, x, r)
            version[buf] = i
        elif k == 'r':
            assert version.get(op[1]) == op[2], ('stale or early read', a, op, version.get(op[1]))
        elif k == 'r0':
            assert version.get(op[1]) == op[2], ('read of the wrong round', a, op, version.get(op[1]))
            reading[(a, op[1])] = op[2]
        elif k == 'r1':
            del reading[(a, op[1])]
        pc[a] += 1

problems = 0
for R in range(1, 6):
    for seed in range(4000):
        try:
            run(R, seed)
        except AssertionError as e:
            problems += 1; print('R', R, 'seed', seed, e); break
print('problems', problems)
