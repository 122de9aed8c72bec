// llama.cpp worker for benchmarks/peers.py, through node-llama-cpp's prebuilt CPU binaries.
//
//   node peers_llamacpp.mjs CONFIG_JSON
//
// peers.py copies this file next to its own node_modules (~/.cache/conveyor-peers/llamacpp)
// and runs it there. CONFIG_JSON: {"model": GGUF path, "threads": n, "context_size": tokens
// per sequence, "max_sequences": n}. It loads the model, warms up, then answers one JSON
// command per stdin line ({"op": "run", "prompts": [[ids]], "output_lens": [n]} or
// {"op": "quit"}) with one stdout line "@@PEERS <json>"; with "keep_tokens": true the reply
// also holds each request's token ids ("token_ids"). Everything else it prints is log.
//
// Token ids go in as they are (the GGUF's vocabulary is the converted model's); greedy
// (temperature 0); a request stops after exactly its output length (EOS does not stop
// `sequence.evaluate`, i.e. ignore_eos). Concurrent requests each get a sequence of one
// context, which llama.cpp decodes in shared batches.
import { getLlama, LlamaLogLevel } from "node-llama-cpp";
import readline from "node:readline";

const config = JSON.parse(process.argv[2]);
const reply = (data) => process.stdout.write("@@PEERS " + JSON.stringify(data) + "\n");
const now = () => Number(process.hrtime.bigint()) / 1e9;

const loadStart = now();
const llama = await getLlama({ gpu: false, build: "never", maxThreads: config.threads, logLevel: LlamaLogLevel.warn });
const model = await llama.loadModel({ modelPath: config.model, gpuLayers: 0 });
// A one-sequence context for single-stream decode, and a context of max_sequences
// sequences (each with context_size cells of its own) for the concurrent workloads.
const single = await model.createContext({
    contextSize: config.single_context_size ?? config.context_size, sequences: 1, threads: config.threads,
});
const multi = config.max_sequences > 1
    ? await model.createContext({ contextSize: config.context_size, sequences: config.max_sequences, threads: config.threads })
    : null;

async function generate(sequence, prompt, maxTokens) {
    const stamps = [];
    const ids = [];
    let count = 0;
    if (maxTokens > 0) {
        for await (const token of sequence.evaluate(prompt, { temperature: 0, yieldEogToken: true })) {
            stamps.push(now());
            ids.push(token);
            if (++count >= maxTokens) break;
        }
    }
    return { tokens: count, first: stamps[0], last: stamps[stamps.length - 1], ids };
}

async function run(prompts, outputLens, keepTokens = false) {
    const context = prompts.length === 1 ? single : multi;
    if (context === null) throw new Error(`${prompts.length} concurrent requests need max_sequences >= ${prompts.length}`);
    if (prompts.length > context.totalSequences) throw new Error(`only ${context.totalSequences} sequences`);
    const sequences = prompts.map(() => context.getSequence());
    const start = now();
    try {
        const results = await Promise.all(prompts.map((prompt, i) => generate(sequences[i], prompt, outputLens[i])));
        const end = now();
        const out = { seconds: end - start, output_tokens: results.reduce((sum, r) => sum + r.tokens, 0) };
        if (keepTokens) out.token_ids = results.map((r) => r.ids);
        if (prompts.length === 1) {
            out.ttft_s = results[0].first - start;
            out.decode_s = results[0].last - results[0].first;
        }
        return out;
    } finally {
        for (const sequence of sequences) sequence.dispose();
    }
}

// warm-up: one short request, then a few concurrent ones
await run([[1, 2, 3, 4, 5, 6, 7, 8]], [4]);
if (multi) await run([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], [4, 4, 4, 4]);
reply({
    ready: true, load_s: now() - loadStart, version: "node-llama-cpp", build: llama.buildType,
    gpu: llama.gpu, threads: single.currentThreads, context_size: single.contextSize,
    max_sequences: multi ? multi.totalSequences : 1, batch_size: (multi ?? single).batchSize,
});

const lines = readline.createInterface({ input: process.stdin });
for await (const line of lines) {
    if (!line.trim()) continue;
    const command = JSON.parse(line);
    if (command.op === "quit") break;
    try {
        reply(await run(command.prompts, command.output_lens, command.keep_tokens === true));
    } catch (error) {
        reply({ error: String(error && error.stack || error) });
    }
}
await multi?.dispose();
await single.dispose();
await model.dispose();
await llama.dispose();
process.exit(0);
