/*
 * idem.pml: the key protocol of idem as an exhaustively checked Promela model.
 *
 * One scoped key, NC clients (C0 and C1 send the same request, fingerprint
 * 0; with NC == 3, C2 sends another request, fingerprint 1, under the same
 * key), each attempt run by an engine instance (a gateway) that may crash or
 * pause at any of its steps; a store with its own discrete clock (lease,
 * TTL and the shared-failure window W in ticks); an upstream that records
 * every execution with the fence it was given.
 *
 * What each part abstracts (file::function):
 *   store_begin     crates/idem-core/src/memory.rs::MemoryStore::begin
 *                   (= crates/idem-sql/src/common.rs::RawRecord::decides/answer)
 *   store_complete  memory.rs::MemoryStore::complete (ttl == 0: ::release)
 *   Clock           the store's clock (crates/idem-core/src/clock.rs) and
 *                   engine.rs::watchdog (extend every lease/3 while the run
 *                   is alive: a renewing holder's lease never ends)
 *   Client          one caller that retries; each attempt is
 *                   engine.rs::Engine::execute on some gateway:
 *     begin loop      engine.rs::Engine::begin (wait mode, wait_for_change)
 *     ghost claim     crates/idem-gateway/src/guard.rs::GuardedStore::begin_detached
 *                     + settle_ghost (a begin answered after the caller gave up)
 *     run             engine.rs::Engine::run_watched (+ ClaimGuard, on_cancel = Hold)
 *                     crates/idem-http/src/service.rs::Run::run's op (forwards
 *                     Idempotency-Fence) and ::first_response (Store/Release/Hold)
 *     settle          engine.rs::Engine::settle
 *     save            engine.rs::ResultSave::save / attempt_until / retry_in_background
 *     shared release  the new behaviour: a retryable failure is complete(fence,
 *                     failure, ttl = W), or release(fence) when W == 0
 *   Upstream        the service behind the gateway: applies a forwarded
 *                   write (an effect) or answers 5xx without one; a fenced
 *                   service refuses a write whose fence is below the
 *                   highest it saw for the key (docs/PROTOCOL.md "Fences").
 *
 * Properties (named after the assert variables; see docs/model/README.md):
 *   P1_one_effect, P1_fenced_one_effect   one effect per key and request unless
 *                                         a documented fault class occurred
 *   P1_fenced_order                       a fenced upstream never accepts a write
 *                                         whose fence is lower than one it saw
 *   P2_retained_replayed, P2_retained_kept
 *                                         a stored result is replayed, exactly
 *                                         it, to every duplicate within the TTL
 *   P3 (ltl p3)                           no claim stays live for ever
 *   P4_own_response, P4_no_foreign_run    another fingerprint never gets the
 *                                         response, nor runs under a bound key
 *   P5_fence_increases, P5_only_newest_writes
 *                                         fences strictly increase; only the
 *                                         newest claim writes
 *   P6_shared_answer                      a waiting duplicate of a run that
 *                                         ended in a shared release gets its
 *                                         answer, never a run of its own
 *
 * Broken variants (each must yield a counterexample; scripts/model.sh checks):
 *   BUG_NONATOMIC_BEGIN     begin is a read, then a separate write     -> P2/P1
 *   BUG_TAKEOVER_ANY_FP     an ended claim is taken over by any fp     -> P4
 *   BUG_NO_SHARE            a retryable failure is a plain release     -> P6
 *   BUG_COMPLETE_ANY_FENCE  complete does not check the record/fence   -> P2/P5
 *   BUG_FENCE_RESET         fences restart when the record is gone     -> P5
 *   BUG_HOLD_RENEWS         the watchdog goes on renewing after Hold   -> P3
 */

#ifndef NC
#define NC 3            /* clients: 0 and 1 fingerprint 0, 2 fingerprint 1 */
#endif
#ifndef NTRY
#define NTRY 2          /* attempts per client (the first and one retry) */
#endif
#ifndef NTRY_B
#define NTRY_B 1        /* attempts of the other request's client */
#endif
#ifndef MAXF
#define MAXF 1          /* faults in a run: crash, pause, store failure, ghost */
#endif
#ifndef LEASE
#define LEASE 2         /* ticks */
#endif
#ifndef TTL
#define TTL 3           /* ticks a stored result is replayed (>= LEASE, as validate wants) */
#endif
#ifndef SHARE_W
#define SHARE_W 1       /* ticks a retryable failure is shared; 0: plain release */
#endif
#define NF 8            /* fences 1..7 (at most NC * NTRY claims) */

/* record states */
#define ABSENT 0
#define INPROG 1
#define DONE   2
/* stored responses */
#define R_OK   1        /* 2xx/3xx/most 4xx: Action::Store */
#define R_OMIT 2        /* stored without its body (body_omitted) */
#define R_FAIL 3        /* a shared retryable failure (5xx, unreachable) */
#define K_UNKNOWN 4     /* 504, broken body, lost connection: Action::Hold */
/* begin answers */
#define A_ACQ      1
#define A_INFLIGHT 2
#define A_REPLAY   3
#define A_MISMATCH 4
/* why a holder stopped renewing its lease */
#define C_NONE        0
#define C_CRASH_EARLY 1 /* crashed before forwarding: nothing ran */
#define C_CRASH       2 /* crashed after forwarding: the upstream may have run */
#define C_HOLD        3 /* Action::Hold: outcome unknown */
#define C_GAVEUP      4 /* ResultSave gave up (save_wait + save_retry) */
#define C_PAUSE       5 /* gateway paused: the watchdog did not renew */
#define C_RELFAIL     6 /* the (shared) release failed at the store */
#define C_GHOST       7 /* a begin whose caller gave up (guard.rs) */
/* documented fault classes after which a second effect is allowed */
#define F_CRASH  1
#define F_HOLD   2
#define F_GAVEUP 4
#define F_PAUSE  8
#define F_TTL   16      /* the result's TTL passed: a retry is a new request */

#define BIT(x) (1 << (x))

/* ---- the store: one record ---- */
byte st = ABSENT;
bit  rfp;               /* fingerprint of the record */
byte rfence;            /* its fence (DONE: the run whose response is stored) */
byte left;              /* ticks to the lease end (INPROG) or expiry (DONE) */
byte rkind;             /* DONE: R_OK, R_OMIT or R_FAIL */
byte next_fence = 1;    /* store-wide counter (MemoryStore::next_fence) */
bit  rrenew;            /* the holder of the record's claim is alive and renews */
byte rcause;            /* why it stopped renewing (C_*) */

/* ---- wait mode ---- */
byte waiting;           /* BIT(c): client c waits in Engine::begin */
byte waitf[NC];         /* the fence it saw in flight */
byte notify;            /* BIT(c): woken by a shared release, not yet re-begun */
byte sharedw;           /* BIT(c): the run client c waited on ended in a shared release (P6) */

/* ---- the upstream ---- */
int  pending[2];        /* per fingerprint, BIT(f): forwarded with fence f, not yet run */
int  listen;            /* BIT(f): the attempt holding fence f waits for the answer */
int  landed;            /* BIT(f): ... and the write of fence f was applied (an effect) */
int  failedm;           /* BIT(f): ... and it was answered 5xx, no effect */
byte effects[2];        /* effects per fingerprint, unfenced upstream (saturates at 2) */
byte facc[2];           /* writes a fenced upstream accepted, per fingerprint (saturates at 2) */
byte hi;                /* highest fence the fenced upstream saw for the key */

/* ---- ghosts for the properties ---- */
byte faults;            /* faults used (<= MAXF) */
byte fault[2];          /* F_* classes that occurred, per fingerprint */
byte max_granted;       /* highest fence granted so far */
byte ok_fence;          /* the stored result (P2), kept independently of the record */
bit  ok_fp;
byte ok_left;
byte ndone;             /* clients finished */

/* one variable per property: pan names it when its assert fails */
bool P1_one_effect = true, P1_fenced_one_effect = true, P1_fenced_order = true;
bool P2_retained_replayed = true, P2_retained_kept = true;
bool P4_own_response = true, P4_no_foreign_run = true;
bool P5_fence_increases = true, P5_only_newest_writes = true;
bool P6_shared_answer = true;

/* ---------------------------------------------------------------------- */
/* The store steps. Each is called inside an atomic block: one step.       */
/* ---------------------------------------------------------------------- */

/* A new claim for fp (memory.rs::MemoryStore::begin, the Acquired arm).
   took: the record was in progress past its lease (Lease::took_over). */
inline grant(fp, took) {
#ifdef BUG_FENCE_RESET
  /* a per-record counter that starts over once the record is gone */
  if
  :: st == INPROG -> f = rfence + 1
  :: else -> f = 1
  fi;
#else
  f = next_fence;
  next_fence++;
#endif
  P5_fence_increases = (f > max_granted);
  assert(P5_fence_increases);
  max_granted = f;
  /* P4: a request never runs while the key is bound to another one's
     claim (live or ended) or to its retained result */
  P4_no_foreign_run = !((st == INPROG && rfp != fp) || (st == DONE && left > 0 && rfp != fp));
  assert(P4_no_foreign_run);
  /* P2: a retained stored result is never run again */
  P2_retained_replayed = !(ok_left > 0 && ok_fp == fp);
  assert(P2_retained_replayed);
  /* P6: a duplicate that waited on a run which ended in a shared release
     got that run's answer instead */
#if SHARE_W > 0
  P6_shared_answer = !(sharedw & BIT(me));
  assert(P6_shared_answer);
#endif
  /* which documented fault class, if any, lets this claim run again */
  if
  :: took && rfp == fp ->
     if
     :: rcause == C_CRASH  -> fault[fp] = fault[fp] | F_CRASH
     :: rcause == C_HOLD   -> fault[fp] = fault[fp] | F_HOLD
     :: rcause == C_GAVEUP -> fault[fp] = fault[fp] | F_GAVEUP
     :: rcause == C_PAUSE  -> fault[fp] = fault[fp] | F_PAUSE
     :: else -> skip
     fi
  :: else -> skip
  fi;
  st = INPROG; rfp = fp; rfence = f; left = LEASE; rkind = 0;
  rrenew = 1; rcause = C_NONE;
  out = A_ACQ
}

/* Store::begin for fingerprint fp: out, sf (fence seen), okind, ofp. */
inline store_begin(fp) {
  if
  :: st == ABSENT || (st == DONE && left == 0) -> grant(fp, 0)
  :: st == INPROG && left > 0 && rfp == fp -> out = A_INFLIGHT; sf = rfence
  :: st == INPROG && left > 0 && rfp != fp -> out = A_MISMATCH
  :: st == INPROG && left == 0 && rfp == fp -> grant(fp, 1)      /* take over */
#ifdef BUG_TAKEOVER_ANY_FP
  :: st == INPROG && left == 0 && rfp != fp -> grant(fp, 1)
#else
  :: st == INPROG && left == 0 && rfp != fp -> out = A_MISMATCH  /* ended claim, other fp */
#endif
  :: st == DONE && left > 0 && rfp == fp -> out = A_REPLAY; sf = rfence; okind = rkind; ofp = rfp
  :: st == DONE && left > 0 && rfp != fp -> out = A_MISMATCH
  fi
}

/* Store::complete(fence g, response kind k, ttl t) by fingerprint fp;
   t == 0 is Store::release. ok: 1 written, 0 LeaseLost. A change wakes
   the waiters of fence g (wait_for_change); sh: it is a shared release. */
inline store_complete(g, k, t, sh) {
#ifdef BUG_COMPLETE_ANY_FENCE
  if
  :: st != ABSENT ->
#else
  if
  :: st == INPROG && rfence == g ->
#endif
     P5_only_newest_writes = (g == max_granted);
     assert(P5_only_newest_writes);
     P2_retained_kept = !(ok_left > 0);
     assert(P2_retained_kept);
     if
     :: t > 0 -> st = DONE; rkind = k; left = t; rfence = g
     :: else -> st = ABSENT; rkind = 0; left = 0; rfence = 0; rfp = 0
     fi;
     rrenew = 0; rcause = C_NONE;
     if
     :: k == R_OK || k == R_OMIT -> ok_fence = g; ok_fp = fp; ok_left = t
     :: else -> skip
     fi;
     c = 0;
     do
     :: c < NC ->
        if
        :: (waiting & BIT(c)) && waitf[c] == g ->
           notify = notify | BIT(c);
           if :: sh -> sharedw = sharedw | BIT(c) :: else -> skip fi
        :: else -> skip
        fi;
        c++
     :: else -> break
     od;
     c = 0;
     ok = 1
  :: else -> ok = 0
  fi
}

/* The holder of fence f stops renewing (crash, pause, Hold, give-up). */
#define STOP_RENEW(why) if :: st == INPROG && rfence == f -> rrenew = 0; rcause = why :: else -> skip fi
/* A paused holder's gateway runs again: its watchdog's extend works if the
   fence is still current (even past the lease), else LeaseLost stops it.
   Until that extend lands (the next tick) a lease that ended in the pause
   stays ended, and its cause stays C_PAUSE. */
#define RESUME if :: paused -> paused = 0; if :: st == INPROG && rfence == f -> rrenew = 1 :: else -> skip fi :: else -> skip fi

/* ---------------------------------------------------------------------- */
/* The store's clock and the watchdog.                                     */
/* ---------------------------------------------------------------------- */

/* One tick: leases and TTLs run down; a renewing holder's lease is extended
   (engine.rs::watchdog renews every lease/3, ResultSave extends between
   attempts: while its gateway is alive and not paused, a lease never ends).
   Timing assumption (P6): a waiter woken by a shared release calls begin
   again before W ends (ms against W = 1 s), so the tick that would expire a
   shared failure waits for woken waiters. */
active proctype Clock() {
end:
  do
  :: atomic {
       (ndone < NC || left > 0 || ok_left > 0) &&
       !(notify != 0 && st == DONE && rkind == R_FAIL && left == 1) ->
       if :: left > 0 -> left-- :: else -> skip fi;
       if :: ok_left > 1 -> ok_left--
          :: ok_left == 1 ->              /* the stored result is forgotten: F_TTL */
             fault[ok_fp] = fault[ok_fp] | F_TTL; ok_left = 0; ok_fence = 0; ok_fp = 0
          :: else -> skip fi;
       if :: st == INPROG && rrenew -> left = LEASE; rcause = C_NONE :: else -> skip fi
     }
  od
}

/* ---------------------------------------------------------------------- */
/* The upstream: each forwarded request lands (an effect) or fails (5xx).  */
/* ---------------------------------------------------------------------- */

/* The request with fence g of fingerprint p is run by the upstream. */
inline upstream_run(p) {
  pending[p] = pending[p] & ~BIT(g);
  if
  :: true ->  /* the write lands */
     if :: listen & BIT(g) -> landed = landed | BIT(g) :: else -> skip fi;
     if :: effects[p] < 2 -> effects[p]++ :: else -> skip fi;
     P1_one_effect = (effects[p] <= 1 || fault[p] != 0);
     assert(P1_one_effect);
     /* the fenced service: refuse a fence below the highest seen */
     if
     :: g >= hi ->
        P1_fenced_order = (g > hi);   /* one write per fence: never equal */
        assert(P1_fenced_order);
        hi = g;
        if :: facc[p] < 2 -> facc[p]++ :: else -> skip fi;
        P1_fenced_one_effect = (facc[p] <= 1 || fault[p] != 0);
        assert(P1_fenced_one_effect)
     :: else -> skip                  /* refused: a newer claim wrote */
     fi
  :: true ->  /* 5xx / unreachable: no effect */
     if :: listen & BIT(g) -> failedm = failedm | BIT(g) :: else -> skip fi
  fi;
  g = 0
}

#define PICK(m) if :: m & BIT(1) -> g = 1 :: m & BIT(2) -> g = 2 :: m & BIT(3) -> g = 3 \
                   :: m & BIT(4) -> g = 4 :: m & BIT(5) -> g = 5 :: m & BIT(6) -> g = 6 \
                   :: m & BIT(7) -> g = 7 fi

active proctype Upstream() {
  byte g;
end:
  do
  :: atomic { pending[0] != 0 -> PICK(pending[0]); upstream_run(0) }
  :: atomic { pending[1] != 0 -> PICK(pending[1]); upstream_run(1) }
  od
}

/* ---------------------------------------------------------------------- */
/* A client and the engine attempts that serve it.                          */
/* ---------------------------------------------------------------------- */

/* The attempt's locals back to their initial values (fewer distinct states). */
#define RESET f = 0; sf = 0; ofp = 0; out = 0; okind = 0; kind = 0; paused = 0; ok = 0

/* Store::begin as the engine calls it (engine.rs::Engine::begin, one
   iteration of its loop), and what the attempt does with each answer. */
inline answer_begin() {
  P2_retained_replayed = !(ok_left > 0 && ok_fp == fp) || (out == A_REPLAY && sf == ok_fence);
  assert(P2_retained_replayed);
  if
  :: out == A_INFLIGHT -> waitf[me] = sf; waiting = waiting | BIT(me)
  :: out == A_REPLAY ->
     sharedw = sharedw & ~BIT(me);
     P4_own_response = (ofp == fp);
     assert(P4_own_response);
     fin = (okind != R_FAIL);          /* a replayed 5xx: the client retries */
     RESET
  :: out == A_MISMATCH -> sharedw = sharedw & ~BIT(me); fin = 1; RESET   /* 422 */
  :: out == A_ACQ -> sharedw = sharedw & ~BIT(me)
  fi
}

inline do_begin() {
#ifdef BUG_NONATOMIC_BEGIN
  /* the decision is read in one step, the claim written in another */
  atomic {
    waiting = waiting & ~BIT(me); notify = notify & ~BIT(me); waitf[me] = 0;
    if
    :: st == ABSENT || (st == DONE && left == 0) || (st == INPROG && left == 0 && rfp == fp) ->
       out = A_ACQ; sf = (st == INPROG -> 1 : 0)
    :: else -> store_begin(fp)
    fi
  }
  atomic {
    if :: out == A_ACQ -> grant(fp, sf); sf = 0 :: else -> skip fi;
    answer_begin()
  }
#else
  atomic {
    waiting = waiting & ~BIT(me); notify = notify & ~BIT(me); waitf[me] = 0;
    store_begin(fp);
    answer_begin()
  }
#endif
}

/* Forwarded to the upstream with Idempotency-Fence: f. */
#define FORWARD pending[fp] = pending[fp] | BIT(f); listen = listen | BIT(f)
#define UNLISTEN listen = listen & ~BIT(f); landed = landed & ~BIT(f); failedm = failedm & ~BIT(f)

proctype Client(byte me; bit fp) {
  byte tries;
  byte f;          /* the fence this attempt holds */
  byte sf;         /* the fence begin saw (InFlight / Replay) */
  bit  ofp;        /* the fingerprint of a replayed response */
  byte out, okind;
  byte kind;       /* the upstream's answer */
  bit  paused;
  bit  ok;
  bit  fin;        /* a final answer: a stored response or 422 */
  byte c;

  do
  :: tries < (fp == 0 -> NTRY : NTRY_B) && !fin ->
     tries++;
     do_begin();
     /* wait mode: wait_for_change until the record changes or the lease
        ends, then begin again; or the wait deadline passes (409) */
     do
     :: out == A_INFLIGHT ->
        if
        :: atomic { !(st == INPROG && rfence == waitf[me] && left > 0) -> do_begin() }
        :: atomic { waiting = waiting & ~BIT(me); notify = notify & ~BIT(me);
                    sharedw = sharedw & ~BIT(me); waitf[me] = 0; RESET }
        fi
     :: else -> break
     od;
     if
     :: out == A_ACQ -> skip
     :: else -> goto next               /* replayed, 422, 409 */
     fi;

#ifdef GHOST
     /* guard.rs::settle_ghost: the begin answered after its caller gave up
        (503); the claim is released by its fence */
     if
     :: atomic { faults < MAXF -> faults++; store_complete(f, 0, 0, 0); RESET }; goto next
     :: skip
     fi;
#endif

     /* ---- Engine::run_watched: the operation beside its watchdog ---- */
     if
     :: atomic { faults < MAXF -> faults++; STOP_RENEW(C_CRASH_EARLY); RESET }; goto next
     :: atomic { faults < MAXF -> faults++; STOP_RENEW(C_PAUSE); paused = 1 };
        atomic { RESUME; FORWARD }
     :: atomic { FORWARD }
     fi;
     /* service.rs::first_response: which answer, which Action; or the
        gateway crashes while the upstream runs */
     if
     :: atomic { faults < MAXF -> faults++; STOP_RENEW(C_CRASH); UNLISTEN; RESET }; goto next
     :: atomic { (landed & BIT(f)) -> kind = R_OK; UNLISTEN }      /* Store */
     :: atomic { (failedm & BIT(f)) -> kind = R_FAIL; UNLISTEN }   /* Release (shared) */
     :: atomic { kind = K_UNKNOWN; UNLISTEN }                      /* Hold: 504, broken body */
     fi;
     if
     :: atomic { faults < MAXF -> faults++; STOP_RENEW(C_PAUSE); paused = 1 }
     :: skip
     fi;

     /* ---- Engine::settle ---- */
     if
     :: kind == R_OK ->
        /* ResultSave::attempt_until: complete; on a failure extend, then
           retry or (save_wait + save_retry passed) give up */
save:
        if
        :: atomic { RESUME; store_complete(f, kind, TTL, 0); fin = 1; RESET }  /* Stored / LeaseLost */
        :: atomic { faults < MAXF -> faults++; RESUME;
             if
             :: store_complete(f, kind, TTL, 0)   /* timed out, but it was written */
             :: skip                               /* timed out, not written */
             :: kind = R_OMIT                      /* refused: saved next without its body */
             fi }
           if
           :: atomic { !(st == INPROG && rfence == f) -> fin = 1; RESET }     /* extend: LeaseLost */
           :: atomic { st == INPROG && rfence == f }; goto save
           :: atomic { st == INPROG && rfence == f -> STOP_RENEW(C_GAVEUP); fin = 1; RESET }
           fi
        fi
     :: kind == R_FAIL ->
        /* the shared release: complete(f, failure, W); W == 0: release(f) */
        if
        :: atomic { RESUME;
#if SHARE_W > 0 && !defined(BUG_NO_SHARE)
             store_complete(f, R_FAIL, SHARE_W, 1);
#else
             store_complete(f, R_FAIL, 0, 1);
#endif
             RESET }
        :: atomic { faults < MAXF -> faults++; paused = 0; STOP_RENEW(C_RELFAIL); RESET }  /* store failed */
        fi                                /* 5xx: the client retries */
     :: kind == K_UNKNOWN ->
#ifdef BUG_HOLD_RENEWS
        atomic { RESUME; RESET }          /* the watchdog is not stopped */
#else
        atomic { paused = 0; STOP_RENEW(C_HOLD); RESET }   /* 502/504: the client retries */
#endif
     fi;
next:
     skip
  :: else -> break
  od;
  ndone++
}

init {
  atomic {
    run Client(0, 0);
    run Client(1, 0);
#if NC > 2
    run Client(2, 1);
#endif
  }
}

/* P3: no claim stays live for ever: a key whose holder stopped renewing
   (crash, Hold, save given up, pause) frees itself at its lease end, and a
   renewing holder settles. Checked with weak fairness (pan -a -f). */
ltl p3 { [] <> !(st == INPROG && left > 0) }
