// Reference CAR tooling for tests/test_car.py, built on @ipld/car (the IPLD project's reader and writer).
//
//   node car_tool.mjs verify FILE.car        -> JSON {roots, blocks: [{cid, codec, hash, size, ok}]}
//   node car_tool.mjs rewrite IN.car OUT.car -> re-encodes IN with @ipld/car's CarWriter, same order
//
// Install once: npm ci --prefix tests/js
import fs from 'node:fs'
import { Readable } from 'node:stream'
import { CarBlockIterator, CarWriter } from '@ipld/car'
import { sha256 } from 'multiformats/hashes/sha2'
import { equals } from 'multiformats/bytes'
import { blake3 } from '@noble/hashes/blake3.js'

const SHA2_256 = 0x12
const BLAKE3 = 0x1e

async function hashMatches (cid, bytes) {
  if (cid.multihash.code === SHA2_256) {
    return equals((await sha256.digest(bytes)).bytes, cid.multihash.bytes)
  }
  if (cid.multihash.code === BLAKE3) {
    return equals(blake3(bytes, { dkLen: cid.multihash.size }), cid.multihash.digest)
  }
  throw new Error(`unexpected multihash 0x${cid.multihash.code.toString(16)}`)
}

async function verify (file) {
  const iterator = await CarBlockIterator.fromIterable(fs.createReadStream(file))
  const roots = (await iterator.getRoots()).map(String)
  const blocks = []
  for await (const { cid, bytes } of iterator) {
    blocks.push({
      cid: cid.toString(),
      version: cid.version,
      codec: cid.code,
      hash: cid.multihash.code,
      size: bytes.length,
      ok: await hashMatches(cid, bytes)
    })
  }
  return { roots, blocks }
}

async function rewrite (input, output) {
  const iterator = await CarBlockIterator.fromIterable(fs.createReadStream(input))
  const { writer, out } = CarWriter.create(await iterator.getRoots())
  const done = new Promise((resolve, reject) => {
    Readable.from(out).pipe(fs.createWriteStream(output)).on('finish', resolve).on('error', reject)
  })
  for await (const block of iterator) {
    await writer.put(block)
  }
  await writer.close()
  await done
  return { written: output }
}

const [command, ...args] = process.argv.slice(2)
const commands = { verify, rewrite }
if (!(command in commands)) {
  console.error('usage: car_tool.mjs verify FILE | rewrite IN OUT')
  process.exit(2)
}
try {
  console.log(JSON.stringify(await commands[command](...args)))
} catch (err) {
  console.error(`car_tool: ${err.message}`)
  process.exit(1)
}
