"""Offline model of the L1 reuse of gathered X rows: per SM an LRU of C X rows, W warps each on
one row, one gather per warp per step, rows given to SMs round-robin in blocks of 4 (the grid
kernel) or as nnz-balanced runs of consecutive rows (an SM-local schedule).  Prints the hit rate
of three SMs per row order.  Usage: python benchmarks/l1_lru_sim.py GRAPH[,GRAPH] [C] [W]"""
import os
import numpy as np, scipy.sparse as sp, sys
from collections import OrderedDict
from scipy.sparse.csgraph import reverse_cuthill_mckee
d=os.environ.get('SPCOMPILE_GRAPHS', os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data', 'graphs'))
def sim(A, rows_of_sm, W, C):
    """LRU of C X-rows; W warps each on one row, round-robin one access per step."""
    hits=tot=0
    for rows in rows_of_sm:
        cache=OrderedDict(); q=list(rows[::-1]); act=[]
        while q or act:
            while len(act)<W and q:
                r=q.pop(); act.append(list(A.indices[A.indptr[r]:A.indptr[r+1]])[::-1])
            nxt=[]
            for a in act:
                c=a.pop(); tot+=1
                if c in cache: hits+=1; cache.move_to_end(c)
                else:
                    cache[c]=1
                    if len(cache)>C: cache.popitem(last=False)
                if a: nxt.append(a)
            act=nxt
    return hits/tot
def orders(A):
    m=A.shape[0]; deg=np.diff(A.indptr)
    yield 'natural', np.arange(m)
    yield 'degree', np.argsort(-deg,kind='stable')
    yield 'rcm', reverse_cuthill_mckee(A.tocsr(),symmetric_mode=True)
def perm(A,p):
    inv=np.empty_like(p); inv[p]=np.arange(len(p))
    B=A[p][:,p].tocsr(); B.sort_indices(); return B
nsm=132; C=int(sys.argv[2]) if len(sys.argv)>2 else 400; W=int(sys.argv[3]) if len(sys.argv)>3 else 32
for g in sys.argv[1].split(','):
    A=sp.load_npz(f'{d}/{g}.npz').tocsr(); A.sort_indices()
    for name,p in orders(A):
        B=perm(A,p); m=B.shape[0]
        # round-robin blocks of 4 rows over SMs (current), vs contiguous ranges (equal nnz)
        blk=4
        rr=[np.concatenate([np.arange(b*blk,min(m,(b+1)*blk)) for b in range(s,(m+blk-1)//blk,nsm)]) for s in (0,1,2)]
        cs=np.concatenate([[0],np.cumsum(np.diff(B.indptr))]); bounds=np.searchsorted(cs, np.linspace(0,cs[-1],nsm+1))
        ct=[np.arange(bounds[s],bounds[s+1]) for s in (0,40,80)]
        print(g,name,'rr %.3f'%sim(B,rr,W,C),'contig %.3f'%sim(B,ct,W,C),flush=True)
