// An independent IPFS client of `cas-ckpt serve`, for tests/test_http_interop.py.
//
//   node gateway_tool.mjs blocks URL CID...  -> Helia's trustless-gateway block broker fetches each
//       block with URL as its only gateway, and validates it by its multihash (sha2-256 or blake3)
//       as Helia's blockstore does: JSON [{cid, size, base64}] (exit 1 if any block is refused)
//   node gateway_tool.mjs car URL CID [SCOPE] -> fetch URL/ipfs/CID?format=car&dag-scope=SCOPE,
//       read it with @ipld/car, hash-check every block, decode messagepack nodes (@msgpack/msgpack,
//       links are ext 42) and walk the DAG from the root: JSON {contentType, roots, blocks,
//       missing, stray, dfs}
//
// Install once: npm ci --prefix tests/js
import { CarBlockIterator } from '@ipld/car'
import { decode, ExtensionCodec } from '@msgpack/msgpack'
import { fallbackRouter } from '@helia/fallback-router'
import { trustlessGatewayBlockBroker } from '@helia/trustless-gateway-client'
import { defaultLogger } from 'birnam'
import { CID } from 'multiformats/cid'
import { sha256 } from 'multiformats/hashes/sha2'
import { equals } from 'multiformats/bytes'
import { blake3 } from '@noble/hashes/blake3.js'

const SHA2_256 = 0x12
const BLAKE3 = 0x1e
const MSGPACK = 0x0201
const LINK = 42
const HISTORY = 43

async function hashMatches (cid, bytes) {
  if (cid.multihash.code === SHA2_256) {
    return equals((await sha256.digest(bytes)).bytes, cid.multihash.bytes)
  }
  if (cid.multihash.code === BLAKE3) {
    return equals(blake3(bytes, { dkLen: cid.multihash.size }), cid.multihash.digest)
  }
  throw new Error(`unexpected multihash 0x${cid.multihash.code.toString(16)}`)
}

// -- Helia's block broker -----------------------------------------------------------------------
async function blocks (url, ...cids) {
  const broker = trustlessGatewayBlockBroker({ allowInsecure: true, allowLocal: true })({
    routing: fallbackRouter({ gateways: [url] }),
    logger: defaultLogger()
  })
  const out = []
  for (const text of cids) {
    const cid = CID.parse(text)
    const bytes = await broker.retrieve(cid, {
      validateFn: async (block) => {
        if (!(await hashMatches(cid, block))) {
          throw new Error(`block ${cid} does not match its hash`)
        }
      }
    })
    out.push({ cid: cid.toString(), size: bytes.length, base64: Buffer.from(bytes).toString('base64') })
  }
  return out
}

// -- CAR streams ----------------------------------------------------------------------------------
class Link {
  constructor (cid, history) {
    this.cid = cid
    this.history = history
  }
}

const extensions = new ExtensionCodec()
for (let type = 1; type <= 127; type++) {
  if (type === LINK || type === HISTORY) {
    extensions.register({ type, encode: () => null, decode: (data) => new Link(CID.decode(data), type === HISTORY) })
  } else {
    // every other extension's payload is itself a msgpack value (docs/format.md, "Nodes")
    extensions.register({ type, encode: () => null, decode: (data) => ({ ext: type, value: decodeNode(data) }) })
  }
}

function decodeNode (bytes) {
  return decode(bytes, { extensionCodec: extensions, useBigInt64: true })
}

function strongLinks (value, found = []) {
  if (value instanceof Link) {
    if (!value.history) found.push(value.cid.toString())
  } else if (Array.isArray(value)) {
    for (const item of value) strongLinks(item, found)
  } else if (value instanceof Map) {
    for (const item of value.values()) strongLinks(item, found)
  } else if (value !== null && typeof value === 'object' && !(value instanceof Uint8Array)) {
    for (const item of Object.values(value)) strongLinks(item, found)
  }
  return found
}

async function car (url, cid, scope) {
  const target = `${url}/ipfs/${cid}?format=car${scope ? `&dag-scope=${scope}` : ''}`
  const response = await fetch(target, { headers: { Accept: 'application/vnd.ipld.car' } })
  if (!response.ok) {
    throw new Error(`${target}: HTTP ${response.status} ${await response.text()}`)
  }
  const iterator = await CarBlockIterator.fromIterable(response.body)
  const roots = (await iterator.getRoots()).map(String)
  const order = []
  const children = new Map()
  for await (const { cid: blockCid, bytes } of iterator) {
    const name = blockCid.toString()
    order.push({ cid: name, size: bytes.length, ok: await hashMatches(blockCid, bytes) })
    children.set(name, blockCid.code === MSGPACK ? strongLinks(decodeNode(bytes)) : [])
  }
  // Depth first from the root, each block once, children in order: the order the CAR must have.
  const walked = []
  const seen = new Set()
  const missing = []
  const stack = [roots[0]]
  while (stack.length > 0) {
    const next = stack.pop()
    if (seen.has(next)) continue
    seen.add(next)
    if (!children.has(next)) {
      missing.push(next)
      continue
    }
    walked.push(next)
    stack.push(...[...children.get(next)].reverse())
  }
  const stray = order.map(b => b.cid).filter(c => !seen.has(c))
  const dfs = walked.length === order.length && walked.every((c, i) => c === order[i].cid)
  return { contentType: response.headers.get('content-type'), roots, blocks: order, missing, stray, dfs }
}

const [command, ...args] = process.argv.slice(2)
const commands = { blocks, car }
if (!(command in commands)) {
  console.error('usage: gateway_tool.mjs blocks URL CID... | car URL CID [SCOPE]')
  process.exit(2)
}
try {
  console.log(JSON.stringify(await commands[command](...args)))
} catch (err) {
  console.error(`gateway_tool: ${err.message}${err.errors ? ': ' + err.errors.map(e => e.message).join('; ') : ''}`)
  process.exit(1)
}
