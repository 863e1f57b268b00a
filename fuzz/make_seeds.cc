// Writes the seed corpus of every fuzzer (fuzz/corpus/<fuzzer>/): valid inputs made by ferry's own
// encoders, so the fuzzers start from the interesting part of the input space.
// Run: build/fuzz/fuzz/make_seeds fuzz/corpus
#include <fmt/core.h>

// clang-format off: jpeglib.h needs stdio's FILE and size_t declared first.
#include <jpeglib.h>

#include <cstdio>
// clang-format on
#include <png.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "kv/kv_transfer_params.h"
#include "kv/peer_messages.h"
#include "media/embeddings_file.h"
#include "schema/ec_transfer_params.h"
#include "schema/kv_transfer_params.h"
#include "schema/openai_error.h"
#include "transfer/metadata.h"
#include "transfer/wire.h"
#ifdef FERRY_SEED_UCX
#include "transfer/backends/ucx/ucx_messages.h"
#endif

using namespace ferry;        // NOLINT: a seed writer over the decoders' namespaces
using namespace ferry::wire;  // NOLINT

namespace {

void Put(const std::string& dir, const std::string& name, const std::string& bytes) {
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

// An image of w x h pixels with `channels` samples each, as a PNG (libpng's writer).
std::string SeedPng(int w, int h, uint32_t format, int channels) {
    std::vector<uint8_t> px(size_t(w) * h * channels);
    for (size_t i = 0; i < px.size(); ++i) px[i] = uint8_t(i * 7);
    png_image img;
    std::memset(&img, 0, sizeof(img));
    img.version = PNG_IMAGE_VERSION;
    img.width = w;
    img.height = h;
    img.format = format;
    png_alloc_size_t size = 0;
    png_image_write_get_memory_size(img, size, 0, px.data(), 0, nullptr);
    std::string out(size, '\0');
    png_image_write_to_memory(&img, out.data(), &size, 0, px.data(), 0, nullptr);
    out.resize(size);
    return out;
}

// The same as a JPEG (libjpeg's encoder), colour or grey, baseline or progressive.
std::string SeedJpeg(int w, int h, int components, bool progressive) {
    std::vector<uint8_t> px(size_t(w) * h * components);
    for (size_t i = 0; i < px.size(); ++i) px[i] = uint8_t(i * 3);
    jpeg_compress_struct c;
    jpeg_error_mgr err;
    c.err = jpeg_std_error(&err);
    jpeg_create_compress(&c);
    unsigned char* buf = nullptr;
    unsigned long size = 0;
    jpeg_mem_dest(&c, &buf, &size);
    c.image_width = w;
    c.image_height = h;
    c.input_components = components;
    c.in_color_space = components == 1 ? JCS_GRAYSCALE : JCS_RGB;
    jpeg_set_defaults(&c);
    if (progressive) jpeg_simple_progression(&c);
    jpeg_start_compress(&c, TRUE);
    while (c.next_scanline < c.image_height) {
        JSAMPROW row = px.data() + size_t(c.next_scanline) * w * components;
        jpeg_write_scanlines(&c, &row, 1);
    }
    jpeg_finish_compress(&c);
    jpeg_destroy_compress(&c);
    std::string out(reinterpret_cast<char*>(buf), size);
    std::free(buf);
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    std::string root = argc > 1 ? argv[1] : "fuzz/corpus";
    // wire: first byte picks the decoder.
    Hello h;
    h.name = "prefill-0";
    h.epoch = 7;
    Put(root + "/wire", "hello", std::string(1, 1) + EncodeHello(h));
    DataRequest d;
    d.segments = {{1, 0x1234, 0, 4096}, {2, 0x99, 8192, 65536}};
    Put(root + "/wire", "data", std::string(1, 3) + EncodeDataRequest(d));
    PullRequest p;
    p.key = "mm:abc";
    p.capacity = 1 << 20;
    Put(root + "/wire", "pull", std::string(1, 4) + EncodePullRequest(p));
    Put(root + "/wire", "header",
        std::string(1, 0) + MakeFrame(FrameType::kHello, 1, EncodeHello(h)).substr(0, 32));
    // metadata
    AgentMetadata md;
    md.name = "decode-1";
    md.epoch = 3;
    md.host_id = "boot/netns";
    md.endpoints = {{"tcp", "127.0.0.1:7300"}, {"shm", "host/sock"}};
    md.regions = {{1, 1 << 20, 0xabc, MemoryKind::kHost}};
    Put(root + "/metadata", "agent", EncodeMetadata(md));
    // gguf: a tokenizer and a few tensors.
    gguf::GgufWriter w;
    w.SetString("general.architecture", "llama");
    w.SetUint32("llama.embedding_length", 4);
    w.SetUint32("llama.block_count", 1);
    w.SetUint32("llama.attention.head_count", 2);
    w.SetUint32("llama.feed_forward_length", 8);
    w.SetString("tokenizer.ggml.model", "llama");
    w.SetStringArray("tokenizer.ggml.tokens",
                     {"<unk>", "<s>", "</s>", "\xe2\x96\x81h", "e", "<0x41>"});
    w.SetInt32Array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 6});
    w.SetFloat32Array("tokenizer.ggml.scores", {0, 0, 0, -1, -2, 0});
    (void)w.AddTensor("token_embd.weight", {4, 6}, gguf::TensorType::kF32, std::string(96, '\0'));
    (void)w.AddTensor("output_norm.weight", {4}, gguf::TensorType::kF16, std::string(8, '\1'));
    std::string tmp = root + "/.seed.gguf";
    if (!w.Write(tmp).ok()) return 1;
    std::ifstream in(tmp, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::filesystem::remove(tmp);
    Put(root + "/gguf", "spm-model", bytes);
    // requests: first byte's bit 0 picks chat, bit 1 a worker that takes images.
    Put(root + "/openai_request", "completion",
        std::string(1, 0) + R"({"model":"m","prompt":"Hello","max_tokens":8,"temperature":0.7,)"
                            R"("top_p":0.9,"top_k":40,"seed":1,"stop":["\n"],"stream":true,)"
                            R"("stream_options":{"include_usage":true},"logprobs":2})");
    Put(root + "/openai_request", "tokens", std::string(1, 0) + R"({"prompt":[1,2,3,250]})");
    Put(root + "/openai_request", "chat",
        std::string(1, 1) + R"({"messages":[{"role":"system","content":"Be brief."},)"
                            R"({"role":"user","content":[{"type":"text","text":"Hi"}]}],)"
                            R"("max_completion_tokens":4,"logprobs":true,"top_logprobs":2})");
    Put(root + "/openai_request", "chat-images",
        std::string(1, 3) +
            R"({"messages":[{"role":"user","content":[{"type":"text","text":)"
            R"("See "},{"type":"image_url","image_url":{"url":"data:image/png;)"
            R"(base64,iVBORw0KGgo=","detail":"low"}},{"type":"text","text":)"
            R"(" and "},{"type":"image_url","image_url":{"url":"file:///a.png"}}]}]})");
    Put(root + "/openai_request", "chat-images-ec",
        std::string(1, 3) +
            R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":)"
            R"({"url":"data:image/png;base64,iVBORw0KGgo="}}]}],"ec_transfer_params":)"
            R"({"engine_id":"ferry-encode-1","host":"127.0.0.1","port":7301,)"
            R"("encoder":"0123456789abcdef0123456789abcdef"},"response_format":{"type":"text"}})");
    // tokenizer: first byte picks the pre-tokenizer.
    Put(root + "/tokenizer", "text", std::string(1, 1) + "Hello world's 1234567  abc\n\n x");
    Put(root + "/tokenizer", "unicode",
        std::string(1, 0) + "caf\xc3\xa9 \xe4\xb8\xad 12 <|im_start|>");
    // discovery store requests: the first byte picks the endpoint (store_request_fuzzer.cc).
    Put(root + "/store_request", "grant", std::string(1, 0) + R"({"ttl_ms":5000})");
    Put(root + "/store_request", "keepalive", std::string(1, 1) + R"({"lease":12345})");
    Put(root + "/store_request", "put",
        std::string(1, 4) + R"({"key":"ferry/agents/a","value":"aGVsbG8=","lease":0})");
    Put(root + "/store_request", "get", std::string(1, 5) + R"({"key":"ferry/agents/a"})");
    Put(root + "/store_request", "list", std::string(1, 6) + R"({"prefix":"ferry/"})");
    Put(root + "/store_request", "delete", std::string(1, 7) + R"({"key":"ferry/agents/a"})");
    Put(root + "/store_request", "watch",
        std::string(1, 8) + R"({"prefix":"ferry/","after":0,"timeout_ms":1})");
    // kv peer messages: first byte picks the sending peer (kv_messages_fuzzer.cc).
    {
        namespace msg = kv::msg;
        const std::string nonce(32, 'a'), prompt(64, 'b');
        msg::Hello hello;
        hello.compat = {.protocol = msg::kProtocolVersion,
                        .model = "fuzz",
                        .attention = "gqa",
                        .layers = 2,
                        .kv_heads = 2,
                        .head_dim = 8,
                        .dtype = "f32",
                        .block_tokens = 16,
                        .layout = "HND",
                        .tp = 1};
        hello.ranks = {{1, 32, 2}};
        hello.addr = "127.0.0.1:1";
        msg::Hello ack = hello;
        ack.ack = true;
        kv::FirstToken first{5, -0.25f, {{5, -0.25f}}};
        const std::pair<const char*, msg::PeerMessage> seeds[] = {
            {"hello", hello},
            {"hello-ack", ack},
            {"claim", msg::Claim{"r1", nonce, "l1", prompt, {0, 1}}},
            {"claim-ack", msg::ClaimAck{"l1", true, first, "", ""}},
            // --kv-verify: the units asked for, the sums answered.
            {"claim-verify",
             msg::Claim{"r1", nonce, "l1", prompt, {0, 1}, msg::VerifyRequest{0, 20, {0, 3, 7}}}},
            {"claim-ack-sums", msg::ClaimAck{"l1", true, first, "", "", {1, 2, 3}}},
            {"push-target-verify",
             msg::PushTarget{"x1", "l1", {0, 1}, 0, 20, prompt, msg::VerifyRequest{0, 20, {1}}}},
            {"push-done-sums", msg::PushEnd{msg::PushEnd::Kind::kDone, "x1", "l1", first, "", {9}}},
            {"claim-refused", msg::ClaimAck{"l1", false, std::nullopt, "gone", "gone"}},
            {"read-done", msg::HoldEnd{msg::HoldEnd::Kind::kReadDone, "r1", nonce}},
            {"release", msg::HoldEnd{msg::HoldEnd::Kind::kRelease, "r1", nonce}},
            {"hold-renew", msg::HoldRenew{"r1", nonce, 3000}},
            {"push-target", msg::PushTarget{"x1", "l1", {0, 1}, 0, 20, prompt}},
            {"push-alive", msg::PushAlive{"x1", "l1", 3000}},
            {"push-cancel", msg::PushCancel{"x1", "l1"}},
            {"push-done", msg::PushEnd{msg::PushEnd::Kind::kDone, "x1", "l1", first, ""}},
            {"push-failed",
             msg::PushEnd{msg::PushEnd::Kind::kFailed, "x1", "l1", std::nullopt, "no"}},
        };
        for (const auto& [name, m] : seeds) {
            Put(root + "/kv_messages", name, std::string(1, 0) + msg::Encode(m));
        }
        // The same bytes are parsed as kv_transfer_params too.
        kv::KvTransferParams pull;
        pull.do_remote_prefill = true;
        pull.remote_engine_id = "p0";
        pull.remote_host = "127.0.0.1";
        pull.remote_port = 7000;
        pull.remote_block_ids = {0, 1, 2};
        pull.remote_request_id = "cmpl-r1";
        pull.hold_nonce = nonce;
        pull.first_token = first;
        Put(root + "/kv_messages", "params-pull", std::string(1, 0) + pull.ToJson().dump());
        Put(root + "/kv_messages", "params-push",
            std::string(1, 0) +
                R"({"do_remote_decode":true,"transfer_mode":"push","transfer_id":"x1"})");
    }
    // schema: first byte picks the decoder (schema_fuzzer.cc).
    {
        const std::string dir = root + "/schema";
        Put(dir, "kv-pull-request", std::string(1, 0) + schema::PullPrefillRequestParams().dump());
        Put(dir, "kv-push-decode",
            std::string(1, 1) +
                schema::PushDecodeRequestParams("x1", {"p0", "::1", 7001}, 2).dump());
        schema::EcTransferParams ec;
        static_cast<schema::AgentAddress&>(ec) = {"enc-0", "127.0.0.1", 7400};
        ec.encoder = "vit";
        Put(dir, "ec-params", std::string(1, 2) + schema::EcTransferParamsJson(ec).dump());
        Put(dir, "agent", std::string(1, 3) + R"({"engine_id":"p","port":7001,"tp_size":2})");
        Put(dir, "error",
            std::string(1, 4) +
                schema::OpenAiErrorJson(400, {"too long", "messages", "context_length_exceeded"},
                                        "req-1")
                    .dump());
    }
    fmt::print("seeds written under {}\n", root);
#ifdef FERRY_SEED_UCX
    // ucx_messages: first byte picks the decoder (as in ucx_messages_fuzzer.cc).
    {
        namespace ucx = ferry::ucx;
        const std::string dir = root + "/ucx_messages";
        ucx::Envelope to{0x1122334455667788ull, 0x99};
        Put(dir, "announce", std::string(1, 1) + ucx::Encode(ucx::Announce{to, 7, 1}));
        Put(dir, "revoke", std::string(1, 2) + ucx::Encode(ucx::Revoke{to, 7, 3, 9}, false));
        Put(dir, "revoke-ack", std::string(1, 3) + ucx::Encode(ucx::Revoke{to, 7, 3, 0}, true));
        Put(dir, "notify", std::string(1, 4) + ucx::Encode(ucx::NotifyHeader{to, "prefill-0"}));
        ucx::DataRequest d{{to, 7, 42}, {{1, 0xabc, 0, 4096}, {2, 0xdef, 8192, 512}}};
        Put(dir, "data", std::string(1, 5) + ucx::Encode(d));
        Put(dir, "grant",
            std::string(1, 6) + ucx::Encode(ucx::GrantRequest{{to, 7, 43}, 1, 0xabc}));
        Put(dir, "pull",
            std::string(1, 7) + ucx::Encode(ucx::PullRequest{{to, 7, 44}, 1 << 20, "kv/req-1"}));
        Put(dir, "reply",
            std::string(1, 8) +
                ucx::Encode(ucx::Reply{42, 0x99, Code::kNotFound, 0, "no region 3"}));
        Put(dir, "grant-answer",
            std::string(1, 9) + ucx::Encode(ucx::GrantAnswer{0x7f0000001000ull, 1 << 20, "rkey"}));
        Put(dir, "address", std::string(1, 11) + ucx::FormatAddress("worker-address", 0x1234));
    }
#endif
    // image: PNGs of each pixel format, JPEGs baseline and progressive, one cut short.
    Put(root + "/image", "rgb.png", SeedPng(8, 6, PNG_FORMAT_RGB, 3));
    Put(root + "/image", "rgba.png", SeedPng(5, 7, PNG_FORMAT_RGBA, 4));
    Put(root + "/image", "grey.png", SeedPng(9, 4, PNG_FORMAT_GRAY, 1));
    Put(root + "/image", "grey16.png", SeedPng(4, 4, PNG_FORMAT_LINEAR_Y, 2));
    Put(root + "/image", "rgb.jpg", SeedJpeg(16, 16, 3, false));
    Put(root + "/image", "progressive.jpg", SeedJpeg(16, 8, 3, true));
    Put(root + "/image", "grey.jpg", SeedJpeg(8, 8, 1, false));
    std::string cut = SeedJpeg(16, 16, 3, false);
    Put(root + "/image", "truncated.jpg", cut.substr(0, cut.size() * 2 / 3));
    // embeddings_file: files as the disk connector and the encoder cache's disk tier write them
    // (shape bytes first: rows, width).
    const std::string ef = root + "/.seed.safetensors";
    for (auto [rows, width] : {std::pair<int, int>{3, 4}, {1, 1}, {16, 8}}) {
        std::vector<float> floats(size_t(rows * width));
        for (size_t i = 0; i < floats.size(); ++i) floats[i] = 0.25f * float(i) - 1;
        media::FileMetadata meta = {{"producer", "ferry"}};
        if (rows == 16) meta = {{"mm_hash", std::string(64, 'a')}, {"encoder", "fingerprint"}};
        if (!media::WriteEmbeddingsFile(ef, floats, size_t(width), meta).ok()) return 1;
        std::ifstream in(ef, std::ios::binary);
        const std::string file((std::istreambuf_iterator<char>(in)), {});
        Put(root + "/embeddings_file", fmt::format("{}x{}", rows, width),
            std::string{char(rows), char(width)} + file);
    }
    std::filesystem::remove(ef);
    return 0;
}
