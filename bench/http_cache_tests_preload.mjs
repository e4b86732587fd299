// Loaded with `node --import` into the HTTP cache test suite's processes by
// bench/http_cache_tests.py; the suite's own files are used unchanged.
//
// CACHE_TESTS_SETUP_ORIGIN (the client): the suite's CLI sends its bookkeeping through
// the cache under test: `PUT /config/<uuid>` (the requests the origin should expect) and
// `GET /state/<uuid>` (what the origin saw). shardcache answers GET and HEAD only, so
// every test would end as a setup failure. These two requests go straight to the origin
// instead; every request of the tests themselves still goes through the proxy.
//
// CACHE_TESTS_LISTEN_HOST (the origin): the suite's server listens on every interface;
// this binds it to the given address (127.0.0.1).

import net from 'node:net'

const origin = process.env.CACHE_TESTS_SETUP_ORIGIN
const base = process.env.npm_config_base
if (origin && base) {
  const realFetch = globalThis.fetch
  globalThis.fetch = function (url, init) {
    if (typeof url === 'string' &&
        (url.startsWith(base + '/config/') || url.startsWith(base + '/state/'))) {
      url = origin + url.slice(base.length)
    }
    return realFetch(url, init)
  }
}

const host = process.env.CACHE_TESTS_LISTEN_HOST
if (host) {
  const listen = net.Server.prototype.listen
  net.Server.prototype.listen = function (port, ...rest) {
    if (typeof port === 'number' || typeof port === 'string') {
      return listen.call(this, port, host, ...rest)
    }
    return listen.call(this, port, ...rest)
  }
}
