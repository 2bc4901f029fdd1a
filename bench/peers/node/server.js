// The Node peer of sluice's benchmark: the usual way a Node shop builds a rate-limiting proxy.
// express for the request pipeline, rate-limiter-flexible's RateLimiterRedis (on ioredis) for
// the limit, keyed by the x-api-key header (the client IP when it is absent), and http-proxy to
// forward admitted requests over kept-alive connections.
//
// Configuration comes from the environment, set by bench/harness/peers.py:
//   PORT            where to listen (127.0.0.1 only)
//   UPSTREAM        the upstream's URL, e.g. http://127.0.0.1:8081
//   REDIS_PORT      the Redis on 127.0.0.1
//   LIMIT_REQUESTS  requests per window and key
//   LIMIT_WINDOW_S  the window in whole seconds (rate-limiter-flexible's fixed window)
//   WORKERS         processes (node:cluster); the harness sets the number of cores, as nginx's
//                   worker_processes and HAProxy's nbthread get
//
// GET /__ready answers 200 once this worker's Redis connection is ready; it is the only path
// the limiter does not see.

'use strict';

const cluster = require('node:cluster');
const http = require('node:http');

const workers = Number(process.env.WORKERS || 1);

if (cluster.isPrimary && workers > 1) {
  for (let i = 0; i < workers; i += 1) cluster.fork();
  // A worker that dies is not replaced: the harness's readiness check and its numbers should
  // show the failure, not hide it.
  cluster.on('exit', (worker, code) => console.error(`worker ${worker.process.pid} exited (${code})`));
  process.on('SIGTERM', () => {
    for (const worker of Object.values(cluster.workers)) worker.kill('SIGTERM');
    process.exit(0);
  });
} else {
  serve();
}

function serve() {
  const express = require('express');
  const httpProxy = require('http-proxy');
  const Redis = require('ioredis');
  const { RateLimiterRedis } = require('rate-limiter-flexible');

  const redis = new Redis({ host: '127.0.0.1', port: Number(process.env.REDIS_PORT) });
  const limiter = new RateLimiterRedis({
    storeClient: redis,
    keyPrefix: 'node',
    points: Number(process.env.LIMIT_REQUESTS),
    duration: Number(process.env.LIMIT_WINDOW_S),
  });

  const agent = new http.Agent({ keepAlive: true, maxSockets: 128 });
  const proxy = httpProxy.createProxyServer({ target: process.env.UPSTREAM, agent, xfwd: true });
  proxy.on('error', (err, req, res) => {
    if (!res.headersSent) res.writeHead(502, { 'content-type': 'text/plain' });
    res.end('bad gateway\n');
  });

  const app = express();
  app.disable('x-powered-by');
  app.disable('etag');

  app.get('/__ready', (req, res) => {
    res.status(redis.status === 'ready' ? 200 : 503).end();
  });

  app.use(async (req, res, next) => {
    const key = req.get('x-api-key') || req.socket.remoteAddress;
    try {
      await limiter.consume(key);
    } catch (rejection) {
      if (rejection instanceof Error) {
        // The store failed: refuse, as sluice does in its default mode.
        res.status(503).set('Retry-After', '1').send('store unavailable\n');
        return;
      }
      res
        .status(429)
        .set('Retry-After', String(Math.max(1, Math.ceil(rejection.msBeforeNext / 1000))))
        .send('Too Many Requests\n');
      return;
    }
    next();
  });

  app.use((req, res) => proxy.web(req, res));

  const server = http.createServer(app);
  server.keepAliveTimeout = 65000;
  server.listen(Number(process.env.PORT), '127.0.0.1');
  process.on('SIGTERM', () => process.exit(0));
}
