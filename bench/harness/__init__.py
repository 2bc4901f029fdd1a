"""sluice's benchmark harness: every target, every scenario, one run, one table.

`bench/run.sh` installs the tools, builds sluice and the load generator, makes a temporary
state directory and then runs this package (`python3 -m bench.harness`); run it through run.sh,
not by hand. Standard library only.

What it does, in order:
  1. starts Redis, the upstream (nginx `return 200`, 1 worker) and every target (the peers,
     the bare-hyper floor of bench/floor, sluice per store and algorithm) on free
     loopback ports, from the templates in bench/peers/ and bench/sluice/, and checks each
     answers as configured (limited targets must answer 429 past the limit);
  2. warms every target up (not in --smoke);
  3. runs the closed-loop scenarios (admit, flood, mixed) with wrk, then the open-loop
     *latency* scenario with bench/loadgen, each as several rounds in which the targets take
     turns, in alternating order, so slow drift on the machine is shared out evenly;
  4. the pinned layout: nginx, Traefik and sluice again with one worker each, alone on one
     CPU, wrk + the upstream + Redis on the other (taskset), admit and flood;
  5. measures Redis's memory per sliding-log key and sluice's resident memory per tracked key,
     the shaped flood and count-by-outcome, what logging costs under a flood, streamed
     tokens, how cost grows (routes, limits per route, Redis memory per identity), what
     renewing concurrency leases costs Redis while requests are held open (leases()), and
     the Redis path across a delayed link (rtt(): 0.2 ms and 1 ms round trips);
  6. prints the tables (CPU per request split into user and kernel, issue 20's targets with
     PASS/MISS, the Redis path per algorithm; for each layout) and the PASS/FAIL lines, and
     (full runs only) writes bench/RESULTS.md.
With --ab BEFORE it does only the A/B of two sluice binaries (see ab.py).

The modules, by concern:
  cli           the command line and the run, step by step (main)
  context       the run's context object (options, servers, Redis, the upstream), passed down
  config        fixed facts: paths, the one limit, algorithms, scenarios (constants only)
  goals         the targets and thresholds, as one table (GOALS), and the verdicts
  servers       starting and stopping processes; procfs: CPU and memory from /proc
  redis_server  the shared Redis; layout: how the cores are shared out
  peers         every target (nginx, HAProxy, Node, Traefik, Envoy, the floor, sluice)
  load          wrk and bench/loadgen, the rounds in turns, the CPU of each run
  summary       the rows of a run and the PASS/FAIL lines; tables: the Markdown tables
  steps/        memory, features, log_cost, tokens, scaling, leases, rtt: one step each
  ab            the A/B of two binaries; report: bench/RESULTS.md

Every server it starts runs in its own process group, recorded in STATE/pgids so run.sh's
trap can stop them even if this process dies, and is stopped here on every exit path.
"""
