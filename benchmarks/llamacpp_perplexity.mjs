// llama.cpp's perplexity of token chunks, for benchmarks/peer_perplexity.py (node-llama-cpp's
// prebuilt CPU binaries; copied next to its node_modules like peers_llamacpp.mjs).
//
//   node llamacpp_perplexity.mjs < {"model": GGUF path, "chunks": [[ids]]}
//
// Each chunk is evaluated from an empty sequence; token j + 1 is scored by the softmax that
// follows token j (temperature 1, no top-k/top-p/min-p: the model's own distribution). Prints
// one line "@@PPL <json>": {"nll": summed negative log-likelihood, "tokens": scored tokens}.
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

const input = JSON.parse(await new Promise((resolve) => {
    let text = "";
    process.stdin.on("data", (chunk) => (text += chunk)).on("end", () => resolve(text));
}));
const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.warn });
const model = await llama.loadModel({ modelPath: input.model, gpuLayers: 0 });
const longest = Math.max(...input.chunks.map((c) => c.length));
const context = await model.createContext({ contextSize: longest, sequences: 1 });
const scoring = { generateNext: { probabilities: true, options: { temperature: 1, topK: 0, topP: 1, minP: 0 } } };

const sequence = context.getSequence();
let nll = 0, tokens = 0;
for (const chunk of input.chunks) {
    await sequence.clearHistory();  // each chunk from an empty sequence
    const items = chunk.slice(0, -1).map((token) => [token, scoring]);
    await sequence.controlledEvaluate(items, {
        onTokenResult(index, result) {  // the full vocabulary's Map per token: read it and drop it
            nll -= Math.log(result.next.probabilities.get(chunk[index + 1]) ?? 1e-30);
            tokens += 1;
        },
    });
}
process.stdout.write("@@PPL " + JSON.stringify({ nll, tokens }) + "\n");
