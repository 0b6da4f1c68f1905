import sys,statistics as st
lines=open(sys.argv[1]).read().split('\n')
ph=[];tk=[]
for l in lines:
    w=l.split()
    if not w: continue
    if w[0]=='PHASES': ph.append([int(w[i]) for i in (2,4,6,8,10,12)])
    if w[0]=='TASKNS': tk.append((int(w[1]),int(w[2]),int(w[3])))
n=int(sys.argv[2]) # tasks per call
calls=len(tk)//n
for c in range(calls):
    T=tk[c*n:(c+1)*n]; P=ph[c*n:(c+1)*n]
    t0=min(t[1] for t in T); t1=max(t[2] for t in T)
    durs=[(t[2]-t[1])/1e3 for t in T]
    loops=[(p[2]+p[3]+p[4]+p[5])/1e3 for p in P]
    sc=sum(p[3] for p in P);so=sum(p[4] for p in P);va=sum(p[5] for p in P);ke=sum(p[2] for p in P)
    tot=sc+so+va+ke
    starts=sorted((t[1]-t0)/1e3 for t in T)
    print(f"call {c}: span {(t1-t0)/1e3:7.0f} us  task us min/med/max {min(durs):5.0f}/{st.median(durs):5.0f}/{max(durs):5.0f}  loop med {st.median(loops):5.0f}  sum tasks {sum(durs):7.0f} sum loops {sum(loops):7.0f}  keys {ke/tot:.2f} scores {sc/tot:.2f} soft {so/tot:.2f} values {va/tot:.2f}  last start {starts[-1]:5.0f} 16th start {starts[15]:4.0f} 17th {starts[16]:4.0f}")
