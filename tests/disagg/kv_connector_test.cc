// Prefill/decode disaggregation through the KV connector, two engines with their own Agents in
// one process (the multi-process tests start `ferry serve` roles). The proof that the KV moved
// right: the decode worker's answer equals a colocated engine's token for token, and the decode
// worker computed none of the prompt itself (its prompt-token counter stays at zero).
#include <fmt/core.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/host_port.h"
#include "engine/engine.h"
#include "kv/agent_connector.h"
#include "kv/peer_messages.h"
#include "serve/worker.h"
#include "testing/testing.h"
#include "testing/tiny_model.h"

namespace ferry {
namespace {

using engine::Engine;
using engine::FinishReason;
using engine::RequestOutput;
using ::ferry::testing::StatusHas;
using kv::KvTransferMode;
using kv::KvTransferParams;

struct Answer {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    FinishReason finish = FinishReason::kNone;
    Status error;
    std::shared_ptr<const KvTransferParams> kv;
    int external = 0;
    bool done = false;
};

// Collects what the engines produce, by request id, and waits for it (bounded).
class Answers {
  public:
    engine::OutputCallback For(const std::string& id) {
        return [this, id](const RequestOutput& o) {
            std::lock_guard lock(mu_);
            Answer& a = map_[id];
            a.tokens.insert(a.tokens.end(), o.tokens.begin(), o.tokens.end());
            a.logprobs.insert(a.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
            if (o.finish != FinishReason::kNone) {
                a.finish = o.finish;
                a.error = o.error;
                a.kv = std::static_pointer_cast<const KvTransferParams>(o.kv_transfer);
                a.external = o.external_tokens;
                a.done = true;
                cv_.notify_all();
            }
        };
    }
    // A bound, not a timing: it returns as soon as every answer is in. Under TSan on two cores
    // 64 colocated prompts took over a minute.
    bool Wait(const std::vector<std::string>& ids,
              std::chrono::milliseconds limit = std::chrono::seconds(300)) {
        std::unique_lock lock(mu_);
        return cv_.wait_for(lock, limit, [&] {
            for (const auto& id : ids) {
                if (!map_[id].done) return false;
            }
            return true;
        });
    }
    Answer Get(const std::string& id) {
        std::lock_guard lock(mu_);
        return map_[id];
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::map<std::string, Answer> map_;
};

struct WorkerOptions {
    int block_tokens = 8;
    int num_blocks = 512;
    int max_batched_tokens = 512;
    std::chrono::milliseconds hold_lease{10000};
    std::chrono::milliseconds transfer_timeout{10000};
    kv::KvVerifyMode verify = kv::KvVerifyMode::kSample;  // the default of `ferry serve`
    bool canary = true;
    int fault_head_offset = 0;  // a mapping bug on purpose (AgentConnectorConfig)
    std::chrono::milliseconds hold_renew_interval{1000};
    bool manual_steps = false;  // the engine steps only when the test calls Step
    std::chrono::milliseconds bootstrap_timeout{30000};
};

// One worker as `ferry serve` assembles it (serve::Worker), without its HTTP server: an Agent,
// its connector, an engine whose caches are the Agent's regions.
struct Worker {
    std::unique_ptr<serve::Worker> parts;  // released last: it stops them in order
    std::shared_ptr<Agent> agent;
    std::shared_ptr<kv::AgentKvConnector> conn;
    std::shared_ptr<Engine> engine;

    std::string host() const { return ParseHostPort(agent->ListenAddress()).value().host; }
    int port() const { return ParseHostPort(agent->ListenAddress()).value().port; }
};

// A connector kind registered by the tests only: the built-in one with a mapping bug on purpose
// (AgentConnectorConfig::fault_head_offset_for_testing, which no option can set).
std::string WrongHeadsKind(int offset) {
    const std::string name = fmt::format("ferry-wrong-heads-{}", offset);
    if (kv::FindKvConnector(name).ok()) return name;
    kv::KvConnectorKind k = testing::ValueOrDie(kv::FindKvConnector(kv::kDefaultKvConnector));
    k.name = name;
    k.create =
        [offset](const kv::KvConnectorContext& c) -> Result<std::shared_ptr<kv::KvConnector>> {
        FERRY_ASSIGN_OR_RETURN(kv::AgentConnectorConfig config, kv::AgentConnectorConfigOf(c));
        config.fault_head_offset_for_testing = offset;
        FERRY_ASSIGN_OR_RETURN(std::shared_ptr<kv::AgentKvConnector> conn,
                               kv::AgentKvConnector::Create(c.agent, config));
        return std::shared_ptr<kv::KvConnector>(std::move(conn));
    };
    EXPECT_TRUE(kv::RegisterKvConnector(std::move(k)).ok());
    return name;
}

// A worker named "prefill-..." has the prefill role, any other the decode role.
Worker MakeWorker(const std::string& name, const std::string& backend,
                  std::shared_ptr<model::Model> model, const WorkerOptions& o = {}) {
    serve::WorkerConfig c;
    c.role =
        name.rfind("prefill", 0) == 0 ? serve::WorkerRole::kPrefill : serve::WorkerRole::kDecode;
    c.model = std::move(model);
    c.agent = testing::TestConfig(name, backend);
    kv::AgentConnectorOptions options;
    options.hold_lease = o.hold_lease;
    options.hold_renew_interval = o.hold_renew_interval;
    options.transfer_timeout = o.transfer_timeout;
    options.bootstrap_timeout = o.bootstrap_timeout;
    options.verify = o.verify;
    options.canary = o.canary;
    c.kv_connector_options = kv::AgentConnectorOptionsJson(options);
    if (o.fault_head_offset != 0) c.kv_connector = WrongHeadsKind(o.fault_head_offset);
    c.engine.block_tokens = o.block_tokens;
    c.engine.num_blocks = o.num_blocks;
    c.engine.max_batched_tokens = o.max_batched_tokens;
    c.engine.manual_steps = o.manual_steps;
    c.serve_http = false;
    Worker w;
    w.parts = testing::ValueOrDie(serve::Worker::Start(std::move(c)), "worker");
    w.agent = w.parts->agent();
    w.conn = std::dynamic_pointer_cast<kv::AgentKvConnector>(w.parts->connector());
    w.engine = w.parts->shared_engine();
    return w;
}

std::vector<int32_t> Prompt(int n, int salt) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back((i * 31 + salt * 17 + 3 + i * i * salt) % 256);
    return t;
}

model::SamplingParams Greedy(int max_tokens) {
    model::SamplingParams sp;
    sp.temperature = 0;
    sp.ignore_eos = true;
    sp.max_tokens = max_tokens;
    sp.logprobs = 0;
    return sp;
}

Status Submit(Engine* e, Answers* answers, const std::string& id, std::vector<int32_t> prompt,
              model::SamplingParams sp, std::shared_ptr<const KvTransferParams> kv = nullptr) {
    engine::Request r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.sampling = sp;
    r.on_output = answers->For(id);
    r.kv_transfer = std::move(kv);
    return e->Submit(std::move(r));
}

// Waits (bounded) until `pred` holds on the engine's stats.
template <typename Pred>
bool WaitStats(Engine* e, Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
        if (pred(e->Stats())) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return pred(e->Stats());
}

class Disagg : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        file_ = new testing::TinyModelFile("kv-connector-test", testing::TinyModelSpec(1024), 5);
        other_ = new testing::TinyModelFile("kv-connector-other", testing::TinyModelSpec(1024), 6);
        // 4 kv heads (8 query heads): TP 1, 2 and 4 each split them.
        model::RandomModelSpec wide = testing::TinyModelSpec(1024);
        wide.num_heads = 8;
        wide.num_kv_heads = 4;
        wide_ = new testing::TinyModelFile("kv-connector-wide", wide, 7);
        mla_ = new testing::TinyModelFile("kv-connector-mla", testing::TinyMlaModelSpec(1024), 8);
    }
    static void TearDownTestSuite() {
        delete mla_;
        delete file_;
        delete other_;
        delete wide_;
    }
    // A model of its own for every engine: Model::Forward takes one caller at a time, and the
    // two workers of a pair compute at the same time (as two processes would).
    static std::shared_ptr<model::Model> Model(int tp) { return file_->Load(tp); }

    // The colocated answers for `prompts` (id -> tokens and logprobs).
    static std::map<std::string, Answer> Colocated(
        const std::vector<std::pair<std::string, std::vector<int32_t>>>& prompts,
        model::SamplingParams sp, int tp = 1, testing::TinyModelFile* file = nullptr) {
        engine::EngineConfig ec;
        ec.block_tokens = 8;
        ec.num_blocks = 512;
        ec.max_batched_tokens = 512;
        Answers answers;  // before the engine: its step thread calls into it until it is gone
        auto e =
            testing::ValueOrDie(Engine::Create((file ? file : file_)->Load(tp), ec), "colocated");
        std::vector<std::string> ids;
        for (const auto& [id, p] : prompts) {
            EXPECT_TRUE(Submit(e.get(), &answers, id, p, sp).ok());
            ids.push_back(id);
        }
        EXPECT_TRUE(answers.Wait(ids));
        std::map<std::string, Answer> out;
        for (const auto& id : ids) out[id] = answers.Get(id);
        return out;
    }

    static testing::TinyModelFile* file_;
    static testing::TinyModelFile* other_;
    static testing::TinyModelFile* wide_;
    static testing::TinyModelFile* mla_;
};
testing::TinyModelFile* Disagg::mla_;
testing::TinyModelFile* Disagg::file_;
testing::TinyModelFile* Disagg::other_;
testing::TinyModelFile* Disagg::wide_;

std::shared_ptr<KvTransferParams> PushPrefillParams(const std::string& xid) {
    auto p = std::make_shared<KvTransferParams>();
    p->mode = KvTransferMode::kPush;
    p->do_remote_decode = true;
    p->transfer_id = xid;
    return p;
}

std::shared_ptr<KvTransferParams> PushDecodeParams(const std::string& xid, const Worker& prefill) {
    auto p = std::make_shared<KvTransferParams>();
    p->mode = KvTransferMode::kPush;
    p->do_remote_prefill = true;
    p->transfer_id = xid;
    p->remote_engine_id = prefill.agent->name();
    p->remote_host = prefill.host();
    p->remote_port = prefill.port();
    return p;
}

struct Case {
    std::string backend;
    int tp;  // the prefill worker's (and the decode worker's, unless decode_tp says otherwise)
    KvTransferMode mode;
    int decode_tp = 0;
    int prefill_bt = 8, decode_bt = 8;  // block sizes
    int DecodeTp() const { return decode_tp > 0 ? decode_tp : tp; }
};
std::string CaseName(const ::testing::TestParamInfo<Case>& i) {
    const std::string tp = i.param.DecodeTp() == i.param.tp
                               ? fmt::format("tp{}", i.param.tp)
                               : fmt::format("tp{}to{}", i.param.tp, i.param.DecodeTp());
    const std::string bt = i.param.prefill_bt == 8 && i.param.decode_bt == 8
                               ? std::string()
                               : fmt::format("_bt{}to{}", i.param.prefill_bt, i.param.decode_bt);
    return fmt::format("{}_{}{}_{}", i.param.backend, tp, bt,
                       i.param.mode == KvTransferMode::kPull ? "pull" : "push");
}
std::vector<Case> Cases() {
    std::vector<Case> out;
    for (const auto& b : AvailableBackends()) {
        for (int tp : {1, 2}) {
            for (auto m : {KvTransferMode::kPull, KvTransferMode::kPush}) out.push_back({b, tp, m});
        }
    }
    return out;
}

class DisaggMatrix : public Disagg, public ::testing::WithParamInterface<Case> {
  protected:
    // Every answer is the colocated one (tokens; logprobs within 1e-4), ended by its length,
    // with every prompt token from the wire; the decoder computed none and no load failed.
    // Returns the prompt tokens.
    static size_t ExpectEqualsColocatedFromTheWire(
        Worker& prefill, Worker& decode,
        const std::vector<std::pair<std::string, std::vector<int32_t>>>& prompts,
        std::map<std::string, Answer>& got, std::map<std::string, Answer>& want) {
        size_t total = 0;
        for (const auto& [id, prompt] : prompts) {
            const Answer& a = got[id];
            EXPECT_EQ(a.finish, FinishReason::kLength) << id << ": " << a.error.ToString();
            EXPECT_EQ(a.tokens, want[id].tokens) << id;
            EXPECT_EQ(a.logprobs.size(), want[id].logprobs.size()) << id;
            for (size_t i = 0; i < std::min(a.logprobs.size(), want[id].logprobs.size()); ++i) {
                EXPECT_NEAR(a.logprobs[i], want[id].logprobs[i], 1e-4) << id << " token " << i;
            }
            EXPECT_EQ(a.external, static_cast<int>(prompt.size())) << id;
            total += prompt.size();
        }
        EXPECT_EQ(decode.engine->Stats().prompt_tokens, 0u);
        EXPECT_EQ(decode.engine->Stats().kv_external_tokens, total);
        EXPECT_EQ(decode.conn->Stats().succeeded, prompts.size());
        EXPECT_EQ(decode.conn->Stats().failed + prefill.conn->Stats().failed, 0u);
        return total;
    }
    // Runs every prompt through prefill -> decode with the case's protocol, all in flight at
    // once, and returns the decode worker's answers.
    std::map<std::string, Answer> RunDisaggregated(
        Worker& prefill, Worker& decode,
        const std::vector<std::pair<std::string, std::vector<int32_t>>>& prompts,
        model::SamplingParams sp) {
        Answers pa, da;
        std::vector<std::string> ids;
        for (const auto& [id, prompt] : prompts) ids.push_back(id);
        if (GetParam().mode == KvTransferMode::kPush) {
            // Decode first for half of them, prefill first for the rest: either order works.
            for (size_t i = 0; i < prompts.size(); ++i) {
                // Named, not a structured binding: clang 14 (the sanitizer builds) cannot capture
                // a binding in a lambda.
                const std::string& id = prompts[i].first;
                const std::vector<int32_t>& prompt = prompts[i].second;
                const std::string xid = "xfer-" + id;
                auto d = [&] {
                    FERRY_EXPECT_OK(Submit(decode.engine.get(), &da, id, prompt, sp,
                                           PushDecodeParams(xid, prefill)));
                };
                auto p = [&] {
                    auto psp = sp;
                    FERRY_EXPECT_OK(
                        Submit(prefill.engine.get(), &pa, id, prompt, psp, PushPrefillParams(xid)));
                };
                if (i % 2) {
                    d();
                    p();
                } else {
                    p();
                    d();
                }
            }
            EXPECT_TRUE(pa.Wait(ids));
        } else {
            // As vLLM's proxy does: prefill with max_tokens 1, then decode with its params.
            for (const auto& [id, prompt] : prompts) {
                auto psp = sp;
                psp.max_tokens = 1;
                auto kvp = std::make_shared<KvTransferParams>();
                kvp->do_remote_decode = true;
                FERRY_EXPECT_OK(Submit(prefill.engine.get(), &pa, id, prompt, psp, kvp));
            }
            EXPECT_TRUE(pa.Wait(ids));
            for (const auto& [id, prompt] : prompts) {
                Answer a = pa.Get(id);
                EXPECT_EQ(a.finish, FinishReason::kLength) << id << " " << a.error.ToString();
                if (!a.kv) {
                    ADD_FAILURE() << id << ": no kv_transfer_params in the prefill answer";
                    continue;
                }
                EXPECT_TRUE(a.kv->do_remote_prefill);
                EXPECT_EQ(a.kv->remote_engine_id, prefill.agent->name());
                EXPECT_EQ(a.kv->remote_request_id, id);
                EXPECT_EQ(a.kv->tp_size, GetParam().tp);
                FERRY_EXPECT_OK(Submit(decode.engine.get(), &da, id, prompt, sp, a.kv));
            }
        }
        EXPECT_TRUE(da.Wait(ids));
        std::map<std::string, Answer> out;
        for (const auto& id : ids) out[id] = da.Get(id);
        return out;
    }
};

TEST_P(DisaggMatrix, DecodeAnswersEqualColocatedAndTheDecoderComputesNoPrompt) {
    const Case c = GetParam();
    // Lengths around block edges (8 tokens), one block, many blocks.
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    int salt = 1;
    for (int n : {1, 7, 8, 9, 16, 17, 63, 100, 257, 600}) {
        prompts.push_back({fmt::format("r{}", n), Prompt(n, salt++)});
    }
    auto sp = Greedy(6);
    auto want = Colocated(prompts, sp, c.tp);

    Worker prefill = MakeWorker("prefill-0", c.backend, Model(c.tp));
    Worker decode = MakeWorker("decode-0", c.backend, Model(c.DecodeTp()));
    auto got = RunDisaggregated(prefill, decode, prompts, sp);
    int total = 0;
    for (const auto& [id, prompt] : prompts) {
        const Answer& a = got[id];
        EXPECT_EQ(a.finish, FinishReason::kLength) << id << ": " << a.error.ToString();
        EXPECT_EQ(a.tokens, want[id].tokens) << id;
        ASSERT_EQ(a.logprobs.size(), want[id].logprobs.size()) << id;
        for (size_t i = 0; i < a.logprobs.size(); ++i) {
            EXPECT_NEAR(a.logprobs[i], want[id].logprobs[i], 1e-5) << id << " token " << i;
        }
        EXPECT_EQ(a.external, static_cast<int>(prompt.size())) << id;
        total += static_cast<int>(prompt.size());
    }
    // The decoder computed no prompt token: every one came over the wire.
    engine::EngineStats ds = decode.engine->Stats();
    EXPECT_EQ(ds.prompt_tokens, 0u);
    EXPECT_EQ(ds.kv_external_tokens, static_cast<uint64_t>(total));
    // Blocks go back: the prefill worker holds nothing once the reads are done, and the decoder
    // only keeps what its prefix cache holds (free for reuse).
    EXPECT_TRUE(WaitStats(prefill.engine.get(),
                          [](const auto& s) { return s.kv_held == 0 && s.kv_blocks_used == 0; }))
        << "prefill held " << prefill.engine->Stats().kv_held << ", used "
        << prefill.engine->Stats().kv_blocks_used;
    EXPECT_TRUE(WaitStats(decode.engine.get(), [](const auto& s) {
        return s.kv_blocks_used == 0 && s.kv_loading == 0;
    }));
    kv::KvConnectorStats cs = decode.conn->Stats();
    EXPECT_EQ(cs.succeeded, prompts.size());
    EXPECT_EQ(cs.failed, 0u);
    kv::KvConnectorStats ps = prefill.conn->Stats();
    EXPECT_EQ(ps.failed, 0u);
    EXPECT_EQ(ps.holding, 0);
    // --kv-verify sample (the default): every request's checksums compared, one unit in 16 of
    // the tiny model's 8 (2 layers x 2 heads x K|V), at least one; each side checked the other's
    // canary at the handshake.
    EXPECT_EQ(cs.verified, prompts.size());
    EXPECT_EQ(cs.verify_units, prompts.size());
    EXPECT_EQ(cs.verify_mismatches, 0u);
    EXPECT_GE(cs.canaries, 1u);
    EXPECT_GE(ps.canaries, 1u);
    EXPECT_EQ(cs.canary_failures + ps.canary_failures, 0u);
    if (c.mode == KvTransferMode::kPull) {
        // One READ per request, a few descriptors each (runs of adjacent blocks per rank).
        EXPECT_EQ(cs.transfers, prompts.size());
        EXPECT_LE(cs.max_descriptors, 2u * c.tp);
        EXPECT_GT(cs.bytes_read, 0u);
    } else {
        EXPECT_GT(ps.bytes_written, 0u);
        // Per layer, rank and chunk: one span per run of blocks adjacent on both sides (K and V
        // together) and two per partial block at either end. The prefill pool hands out blocks
        // freed by finished requests first, so a chunk's table has a few runs; one descriptor
        // per block would be 75 for the 600-token prompt.
        EXPECT_LE(ps.max_descriptors, 16u);
        EXPECT_LE(ps.descriptors, 4 * ps.transfers);
    }
}

INSTANTIATE_TEST_SUITE_P(Protocols, DisaggMatrix, ::testing::ValuesIn(Cases()), CaseName);

// Heterogeneous TP: a prefill worker of TP p and a decode worker of TP d, every p, d in
// {1, 2, 4}, on a model of 4 kv heads. Each decode rank gets its heads from the prefill ranks
// that hold them (strided, straight into its blocks); the answers equal a colocated engine's of
// the decode worker's TP, and the decoder computes no prompt token.
class DisaggHeteroTp : public DisaggMatrix {};
TEST_P(DisaggHeteroTp, EveryDecodeRankGetsItsHeadsFromThePrefillRanksThatHoldThem) {
    const Case c = GetParam();
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    int salt = 1;
    for (int n : {1, 9, 63, 100, 257})
        prompts.push_back({fmt::format("h{}", n), Prompt(n, salt++)});
    auto sp = Greedy(5);
    auto want = Colocated(prompts, sp, c.DecodeTp(), wide_);
    const WorkerOptions all{.verify = kv::KvVerifyMode::kAll};
    Worker prefill = MakeWorker("prefill-h", c.backend, wide_->Load(c.tp), all);
    Worker decode = MakeWorker("decode-h", c.backend, wide_->Load(c.DecodeTp()), all);
    auto got = RunDisaggregated(prefill, decode, prompts, sp);
    // Another layout sums in another order than the decoder's own would have: 1e-4.
    const size_t total = ExpectEqualsColocatedFromTheWire(prefill, decode, prompts, got, want);
    kv::KvConnectorStats cs = decode.conn->Stats(), ps = prefill.conn->Stats();
    // Every head once per decode rank that holds it: the bytes moved are the prompt's KV (times
    // the copies a decode worker of TP 8 keeps of each of the 4 heads), never one copy per rank
    // pair or per prefill rank that holds a copy.
    const kv::KvCacheSpec& s = decode.engine->caches()[0]->spec();
    const uint64_t copies = std::max(1, c.DecodeTp() / 4);
    const uint64_t per_token_all_heads = 2ull * s.num_layers * 4 * s.head_dim * 4 * copies;
    const uint64_t moved = c.mode == KvTransferMode::kPull ? cs.bytes_read : ps.bytes_written;
    EXPECT_GE(moved, total * per_token_all_heads);
    EXPECT_LE(moved, (total + 8 * prompts.size()) * per_token_all_heads);
    // --kv-verify all: every unit (layer, global head, K|V) of every request summed the same on
    // both sides; the canary came through the same rank pairs at the handshake.
    EXPECT_EQ(cs.verified, prompts.size());
    EXPECT_EQ(cs.verify_units, prompts.size() * 2 * s.num_layers * 4);
    EXPECT_EQ(cs.verify_mismatches, 0u);
    EXPECT_GE(cs.canaries, 1u);
    EXPECT_GE(ps.canaries, 1u);
    EXPECT_EQ(cs.canary_failures + ps.canary_failures, 0u);
    if (c.mode == KvTransferMode::kPull) {
        // One READ per request; per (decode rank, prefill rank) pair that share heads and run
        // of adjacent blocks, one strided descriptor when the pair holds the same heads, else
        // one per layer and K|V (a head slice of the run; stride one block), never one per
        // block. At most 2 runs here.
        EXPECT_EQ(cs.transfers, prompts.size());
        // Rank pairs: each decode rank with one prefill rank per head it holds (one copy of a
        // replicated head); the same heads on both ranks of a pair move whole blocks.
        const int heads_p = std::max(1, 4 / c.tp), heads_d = std::max(1, 4 / c.DecodeTp());
        const uint64_t pairs = uint64_t(std::max(std::min(c.tp, 4), std::min(c.DecodeTp(), 4))) *
                               std::max(1, c.DecodeTp() / 4);
        const uint64_t per_run = heads_p == heads_d ? 1 : 2 * uint64_t(s.num_layers);
        EXPECT_LE(cs.max_descriptors, 2 * pairs * per_run);
        EXPECT_GE(cs.max_descriptors, pairs * per_run);
    }
}
std::vector<Case> HeteroCases() {
    std::vector<Case> out;
    for (const auto& b : AvailableBackends()) {
        if (b != "shm" && b != "tcp") continue;
        std::vector<std::pair<int, int>> pairs;
        for (int p : {1, 2, 4}) {
            for (int d : {1, 2, 4}) pairs.push_back({p, d});
        }
        // TP 8 on 4 kv heads: each head on two ranks. Over shm every pairing, over tcp two.
        std::vector<std::pair<int, int>> eight = {{8, 1}, {8, 2}, {8, 4}, {8, 8},
                                                  {1, 8}, {2, 8}, {4, 8}};
        if (b == "tcp") eight = {{8, 2}, {2, 8}};
        if (testing::kSanitized) {
            // Fewer heads on either side, and replication both ways; one pair over tcp.
            pairs = b == "shm" ? std::vector<std::pair<int, int>>{{1, 2}, {4, 1}, {2, 4}}
                               : std::vector<std::pair<int, int>>{{1, 2}};
            eight = b == "shm" ? std::vector<std::pair<int, int>>{{8, 2}, {2, 8}}
                               : std::vector<std::pair<int, int>>{};
        }
        for (auto [p, d] : pairs) {
            for (auto m : {KvTransferMode::kPull, KvTransferMode::kPush}) {
                out.push_back({b, p, m, d});
            }
        }
        for (auto [p, d] : eight) {
            for (auto m : {KvTransferMode::kPull, KvTransferMode::kPush}) {
                out.push_back({b, p, m, d});
            }
        }
    }
    return out;
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggHeteroTp, ::testing::ValuesIn(HeteroCases()), CaseName);

// MLA: the latent (one row per token and layer, the same on every rank) moves once per request,
// whatever the two workers' TP: each worker's ranks share one latent cache, so the connector
// sees one rank on each side. Answers equal a colocated engine's of the decode worker's TP, the
// decoder computes no prompt token, `--kv-verify all` sums every layer's latent rows on both
// sides (one unit a layer) and the canary comes through the same plan at the handshake.
class DisaggMla : public DisaggMatrix {};
TEST_P(DisaggMla, OneLatentCopyMovesPerRequestWhateverTheTp) {
    const Case c = GetParam();
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    int salt = 5;
    for (int n : {1, 9, 63, 100, 257})
        prompts.push_back({fmt::format("m{}", n), Prompt(n, salt++)});
    auto sp = Greedy(5);
    auto want = Colocated(prompts, sp, c.DecodeTp(), mla_);
    WorkerOptions po{.block_tokens = c.prefill_bt, .verify = kv::KvVerifyMode::kAll};
    WorkerOptions dopt{.block_tokens = c.decode_bt, .verify = kv::KvVerifyMode::kAll};
    Worker prefill = MakeWorker("prefill-m", c.backend, mla_->Load(c.tp), po);
    Worker decode = MakeWorker("decode-m", c.backend, mla_->Load(c.DecodeTp()), dopt);
    ASSERT_EQ(prefill.engine->caches().size(), 1u);
    ASSERT_EQ(decode.engine->caches().size(), 1u);
    auto got = RunDisaggregated(prefill, decode, prompts, sp);
    const size_t total = ExpectEqualsColocatedFromTheWire(prefill, decode, prompts, got, want);
    kv::KvConnectorStats cs = decode.conn->Stats(), ps = prefill.conn->Stats();
    const kv::KvCacheSpec& s = decode.engine->caches()[0]->spec();
    ASSERT_TRUE(s.latent);
    // One latent row per token and layer: [latent 32 | rope 8] f32.
    const uint64_t per_token = uint64_t(s.num_layers) * (32 + 8) * 4;
    const uint64_t moved = c.mode == KvTransferMode::kPull ? cs.bytes_read : ps.bytes_written;
    EXPECT_GE(moved, total * per_token);
    EXPECT_LE(moved,
              (total + uint64_t(std::max(c.prefill_bt, c.decode_bt)) * prompts.size()) * per_token);
    EXPECT_EQ(cs.verified, prompts.size());
    EXPECT_EQ(cs.verify_units, prompts.size() * s.num_layers);
    EXPECT_EQ(cs.verify_mismatches, 0u);
    EXPECT_GE(cs.canaries, 1u);
    EXPECT_GE(ps.canaries, 1u);
    EXPECT_EQ(cs.canary_failures + ps.canary_failures, 0u);
    if (c.mode == KvTransferMode::kPull && c.prefill_bt == c.decode_bt) {
        // One READ per request: one strided descriptor per run of adjacent blocks (every layer
        // in it), however many ranks either worker has.
        EXPECT_EQ(cs.transfers, prompts.size());
        EXPECT_LE(cs.max_descriptors, 3u);
    }
}
// Seeded sampling over MLA: the decoder continues the colocated random stream from the latent.
TEST_P(DisaggMla, SeededSamplingGivesTheColocatedTokens) {
    const Case c = GetParam();
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    for (int i = 0; i < 4; ++i) {
        prompts.push_back({fmt::format("ms{}", i), Prompt(10 + 40 * i, 20 + i)});
    }
    model::SamplingParams sp;
    sp.temperature = 0.9f;
    sp.top_p = 0.95f;
    sp.seed = 4321;
    sp.ignore_eos = true;
    sp.max_tokens = 12;
    auto want = Colocated(prompts, sp, c.DecodeTp(), mla_);
    Worker prefill =
        MakeWorker("prefill-ms", c.backend, mla_->Load(c.tp), {.block_tokens = c.prefill_bt});
    Worker decode =
        MakeWorker("decode-ms", c.backend, mla_->Load(c.DecodeTp()), {.block_tokens = c.decode_bt});
    auto got = RunDisaggregated(prefill, decode, prompts, sp);
    for (const auto& [id, p] : prompts) {
        EXPECT_EQ(got[id].finish, FinishReason::kLength) << id << ": " << got[id].error.ToString();
        EXPECT_EQ(got[id].tokens, want[id].tokens) << id;
    }
    EXPECT_EQ(decode.engine->Stats().prompt_tokens, 0u);
}
std::vector<Case> MlaCases() {
    std::vector<Case> out;
    for (const std::string b : {"shm", "tcp"}) {
        std::vector<std::pair<int, int>> tps = {{1, 1}, {1, 2}, {2, 1}, {2, 2}};
        if (b == "tcp") tps = {{1, 2}, {2, 1}};
        if (testing::kSanitized) {
            tps = b == "shm" ? std::vector<std::pair<int, int>>{{1, 2}, {2, 1}}
                             : std::vector<std::pair<int, int>>{{1, 2}};
        }
        for (auto [p, d] : tps) {
            for (auto m : {KvTransferMode::kPull, KvTransferMode::kPush}) {
                out.push_back({b, p, m, d});
            }
        }
    }
    // Block sizes differ too (seed 004 runs 128 on the decoder).
    for (auto m : {KvTransferMode::kPull, KvTransferMode::kPush}) {
        out.push_back({"shm", 1, m, 2, 16, 128});
        out.push_back({"shm", 2, m, 1, 32, 8});
    }
    return out;
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggMla, ::testing::ValuesIn(MlaCases()), CaseName);

// A GQA worker and an MLA worker never pair: the hello names the attention kind of each.
TEST_F(Disagg, AnMlaAndAGqaWorkerAreRefusedAtTheHandshakeNamingTheAttention) {
    Answers pa, da;
    Worker prefill = MakeWorker("prefill-x", "shm", mla_->Load(1));
    Worker decode = MakeWorker("decode-x", "shm", Model(1));
    auto psp = Greedy(1);
    auto kvp = std::make_shared<KvTransferParams>();
    kvp->do_remote_decode = true;
    const std::vector<int32_t> prompt = Prompt(20, 2);
    FERRY_ASSERT_OK(Submit(prefill.engine.get(), &pa, "x", prompt, psp, kvp));
    ASSERT_TRUE(pa.Wait({"x"}));
    ASSERT_TRUE(pa.Get("x").kv);
    FERRY_ASSERT_OK(Submit(decode.engine.get(), &da, "x", prompt, Greedy(2), pa.Get("x").kv));
    ASSERT_TRUE(da.Wait({"x"}));
    const Answer a = da.Get("x");
    EXPECT_EQ(a.finish, FinishReason::kError);
    EXPECT_THAT(a.error.message(),
                ::testing::HasSubstr("attention differs (this worker gqa, 'prefill-x' mla)"));
}

// What lands in the decode worker's blocks is, byte for byte, the head slices of the prefill
// worker's cache: for every prompt block, layer, K and V and global kv head, the decode rank that
// holds the head has the rows the prefill rank that holds it computed.
class DisaggHeteroBytes : public DisaggMatrix {};
TEST_P(DisaggHeteroBytes, TheReceivedRowsAreTheSendersHeadSlices) {
    const Case c = GetParam();
    const std::vector<int32_t> prompt = Prompt(77, 13);  // 9 full blocks of 8 and 5 tokens
    Worker prefill = MakeWorker("prefill-b", c.backend, wide_->Load(c.tp));
    Worker decode = MakeWorker("decode-b", c.backend, wide_->Load(c.DecodeTp()),
                               WorkerOptions{.num_blocks = 64});
    Answers pa, da;
    auto psp = Greedy(1);
    auto kvp = std::make_shared<KvTransferParams>();
    kvp->do_remote_decode = true;
    FERRY_ASSERT_OK(Submit(prefill.engine.get(), &pa, "b", prompt, psp, kvp));
    ASSERT_TRUE(pa.Wait({"b"}));
    const Answer held = pa.Get("b");
    ASSERT_TRUE(held.kv) << held.error.ToString();
    const std::vector<kv::BlockId> pblocks = held.kv->remote_block_ids;
    FERRY_ASSERT_OK(Submit(decode.engine.get(), &da, "b", prompt, Greedy(1), held.kv));
    ASSERT_TRUE(da.Wait({"b"}));
    ASSERT_EQ(da.Get("b").external, 77) << da.Get("b").error.ToString();

    const auto& pc = prefill.engine->caches();
    const auto& dc = decode.engine->caches();
    const int heads = 4, hp = heads / c.tp, hd = heads / c.DecodeTp();
    const kv::KvCacheSpec& spec = pc[0]->spec();
    const int bt = spec.block_tokens;
    const size_t row = size_t(spec.head_dim) * kv::KvDtypeSize(spec.dtype);
    ASSERT_EQ(pblocks.size(), 10u);
    for (size_t k = 0; k < pblocks.size(); ++k) {
        const int n = std::min<int>(bt, 77 - int(k) * bt);  // the prompt's rows in this block
        auto rows = [&](const kv::KvCache& cache, int layer, bool v, int block, int head) {
            return std::string_view(reinterpret_cast<const char*>(cache.memory().data()) +
                                        cache.Offset(layer, v, block, head),
                                    size_t(n) * row);
        };
        // The decode block that holds prompt block k: the one whose first head's layer-0 K rows
        // are the prefill's (random weights: no two blocks share them).
        int found = -1;
        for (int j = 0; j < dc[0]->spec().num_blocks && found < 0; ++j) {
            if (rows(*dc[0], 0, false, j, 0) == rows(*pc[0], 0, false, pblocks[k], 0)) found = j;
        }
        ASSERT_GE(found, 0) << "prompt block " << k << " is in no decode block";
        for (int layer = 0; layer < spec.num_layers; ++layer) {
            for (bool v : {false, true}) {
                for (int g = 0; g < heads; ++g) {
                    EXPECT_EQ(rows(*dc[g / hd], layer, v, found, g % hd),
                              rows(*pc[g / hp], layer, v, pblocks[k], g % hp))
                        << "block " << k << " layer " << layer << (v ? " V" : " K") << " head "
                        << g;
                }
            }
        }
    }
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggHeteroBytes,
                         ::testing::Values(Case{"shm", 1, KvTransferMode::kPull, 2},
                                           Case{"shm", 2, KvTransferMode::kPull, 1},
                                           Case{"shm", 1, KvTransferMode::kPull, 4},
                                           Case{"shm", 4, KvTransferMode::kPull, 2},
                                           Case{"tcp", 2, KvTransferMode::kPull, 4}),
                         CaseName);

// Different block sizes in both directions (16 to 32, 32 to 16, 16 to 128, 128 to 16, and 8 to
// 12, sizes that do not divide each other), pull and push: the transfer is cut where either
// side's block ends; answers equal colocated and the decoder computes no prompt token.
class DisaggBlockSizes : public DisaggMatrix {};
std::vector<Case> BlockCases() {
    std::vector<Case> out;
    for (const std::string b : {"shm", "tcp"}) {
        for (auto [p, d] :
             std::vector<std::pair<int, int>>{{16, 32}, {32, 16}, {16, 128}, {128, 16}, {8, 12}}) {
            if (b == "tcp" && (p == 8 || p == 128)) continue;  // shm covers every pair
            for (auto m : {KvTransferMode::kPull, KvTransferMode::kPush}) {
                out.push_back({b, 1, m, 1, p, d});
            }
        }
    }
    return out;
}
TEST_P(DisaggBlockSizes, TransfersAreCutAtBothSidesBlocksAndEqualColocated) {
    const Case c = GetParam();
    const int pbt = c.prefill_bt, dbt = c.decode_bt;
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    int salt = 3;
    for (int n : {1, 12, 16, 17, 100, 129, 300}) {
        prompts.push_back({fmt::format("k{}", n), Prompt(n, salt++)});
    }
    auto sp = Greedy(5);
    auto want = Colocated(prompts, sp);
    Worker prefill = MakeWorker("prefill-k", c.backend, Model(1), {.block_tokens = pbt});
    Worker decode = MakeWorker("decode-k", c.backend, Model(1), {.block_tokens = dbt});
    auto got = RunDisaggregated(prefill, decode, prompts, sp);
    ExpectEqualsColocatedFromTheWire(prefill, decode, prompts, got, want);
    EXPECT_TRUE(WaitStats(prefill.engine.get(),
                          [](const auto& s) { return s.kv_held == 0 && s.kv_blocks_used == 0; }));
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggBlockSizes, ::testing::ValuesIn(BlockCases()), CaseName);

// 64 requests in flight at once through one pair, every answer still its own (the SGLang thread
// found requests matched to the wrong transfer under concurrency).
class DisaggConcurrency : public DisaggMatrix {};
TEST_P(DisaggConcurrency, SixtyFourAtOnceEachGetsItsOwnKv) {
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    for (int i = 0; i < 64; ++i)
        prompts.push_back({fmt::format("c{}", i), Prompt(20 + i * 5, i + 3)});
    auto sp = Greedy(4);
    auto want = Colocated(prompts, sp);
    // The pull round prefills all 64 before the first decode claims its KV: under a sanitizer
    // on two cores that takes longer than the default 10 s lease, which is not what this test is
    // about (AnUnclaimedHold... tests the lease), so the holds outlast the run.
    const WorkerOptions options{.num_blocks = 2048,
                                .hold_lease = std::chrono::seconds(300),
                                .transfer_timeout = std::chrono::seconds(120)};
    Worker prefill = MakeWorker("prefill-c", GetParam().backend, Model(1), options);
    Worker decode = MakeWorker("decode-c", GetParam().backend, Model(1), options);
    auto got = RunDisaggregated(prefill, decode, prompts, sp);
    for (const auto& [id, p] : prompts) {
        EXPECT_EQ(got[id].tokens, want[id].tokens) << id << ": " << got[id].error.ToString();
    }
    EXPECT_EQ(decode.engine->Stats().prompt_tokens, 0u);
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggConcurrency,
                         ::testing::Values(Case{"shm", 1, KvTransferMode::kPull},
                                           Case{"shm", 1, KvTransferMode::kPush},
                                           Case{"tcp", 1, KvTransferMode::kPush}),
                         CaseName);

// Seeded sampling continues the same random stream on the decoder.
class DisaggSeeded : public DisaggMatrix {};
TEST_P(DisaggSeeded, SeededSamplingGivesTheColocatedTokens) {
    std::vector<std::pair<std::string, std::vector<int32_t>>> prompts;
    for (int i = 0; i < 6; ++i) prompts.push_back({fmt::format("s{}", i), Prompt(10 + 30 * i, i)});
    model::SamplingParams sp;
    sp.temperature = 0.9f;
    sp.top_p = 0.95f;
    sp.seed = 1234;
    sp.ignore_eos = true;
    sp.max_tokens = 12;
    // Also across layouts: the seeded stream does not depend on where the KV came from.
    const Case c = GetParam();
    auto want = Colocated(prompts, sp, c.DecodeTp(), wide_);
    Worker prefill =
        MakeWorker("prefill-s", c.backend, wide_->Load(c.tp), {.block_tokens = c.prefill_bt});
    Worker decode =
        MakeWorker("decode-s", c.backend, wide_->Load(c.DecodeTp()), {.block_tokens = c.decode_bt});
    auto got = RunDisaggregated(prefill, decode, prompts, sp);
    for (const auto& [id, p] : prompts) EXPECT_EQ(got[id].tokens, want[id].tokens) << id;
    EXPECT_EQ(decode.engine->Stats().prompt_tokens, 0u);
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggSeeded,
                         ::testing::Values(Case{"shm", 1, KvTransferMode::kPull},
                                           Case{"shm", 1, KvTransferMode::kPush},
                                           Case{"shm", 2, KvTransferMode::kPull, 1},
                                           Case{"tcp", 1, KvTransferMode::kPush, 4},
                                           Case{"shm", 1, KvTransferMode::kPull, 1, 16, 32},
                                           Case{"shm", 2, KvTransferMode::kPush, 1, 32, 8}),
                         CaseName);

// The decoder's own prefix cache counts: only the blocks it lacks move.
class DisaggPrefix : public DisaggMatrix {};
TEST_P(DisaggPrefix, OnlyTheBlocksTheDecoderLacksMove) {
    auto sp = Greedy(5);
    std::vector<int32_t> shared = Prompt(160, 9);  // 20 blocks of 8
    std::vector<int32_t> longer = shared;
    for (int i = 0; i < 45; ++i) longer.push_back((i * 7 + 1) % 256);
    auto want = Colocated({{"long", longer}}, sp);

    Worker prefill = MakeWorker("prefill-p", "shm", Model(1));
    Worker decode = MakeWorker("decode-p", "shm", Model(1));
    // The decoder computes the shared prefix itself once (a colocated request).
    Answers local;
    FERRY_ASSERT_OK(Submit(decode.engine.get(), &local, "warm", shared, Greedy(1)));
    ASSERT_TRUE(local.Wait({"warm"}));
    const uint64_t computed = decode.engine->Stats().prompt_tokens;

    auto got = RunDisaggregated(prefill, decode, {{"long", longer}}, sp);
    EXPECT_EQ(got["long"].tokens, want["long"].tokens);
    // 20 blocks hit locally; the other 45 tokens came from the prefill worker.
    EXPECT_EQ(got["long"].external, 45);
    EXPECT_EQ(decode.engine->Stats().prompt_tokens, computed);
    EXPECT_EQ(decode.engine->Stats().prefix_hit_tokens, 160u);
    const kv::KvCacheSpec& s = decode.engine->caches()[0]->spec();
    const uint64_t per_token = 2ull * s.num_layers * s.kv_heads * s.head_dim * 4;
    kv::KvConnectorStats cs = decode.conn->Stats(), ps = prefill.conn->Stats();
    uint64_t moved = GetParam().mode == KvTransferMode::kPull ? cs.bytes_read : ps.bytes_written;
    EXPECT_LE(moved, 48 * per_token);  // 45 tokens, rounded up to whole blocks at most
    EXPECT_GE(moved, 45 * per_token);
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggPrefix,
                         ::testing::Values(Case{"shm", 1, KvTransferMode::kPull},
                                           Case{"shm", 1, KvTransferMode::kPush}),
                         CaseName);

TEST_F(Disagg, ChunkedPrefillPushesEachChunkAsItIsComputed) {
    // The prefill worker takes 600 tokens in chunks of 64: every chunk's layers go out as they
    // are stored, partial blocks included, and the answer is still the colocated one.
    auto sp = Greedy(5);
    auto prompt = Prompt(600, 4);
    auto want = Colocated({{"x", prompt}}, sp);
    // Chunks end inside blocks.
    Worker prefill = MakeWorker("prefill-k", "shm", Model(1), {.max_batched_tokens = 61});
    Worker decode = MakeWorker("decode-k", "shm", Model(1));
    Answers pa, da;
    FERRY_ASSERT_OK(
        Submit(decode.engine.get(), &da, "x", prompt, sp, PushDecodeParams("k", prefill)));
    FERRY_ASSERT_OK(Submit(prefill.engine.get(), &pa, "x", prompt, sp, PushPrefillParams("k")));
    ASSERT_TRUE(da.Wait({"x"}));
    EXPECT_EQ(da.Get("x").tokens, want["x"].tokens) << da.Get("x").error.ToString();
    EXPECT_EQ(decode.engine->Stats().prompt_tokens, 0u);
    EXPECT_GE(prefill.conn->Stats().transfers, 10u * 2);  // 10 chunks x 2 layers
}

// A mapping bug on purpose (the side that plans the transfer takes the peer's heads to begin one
// later: pull, the decoder; push, the prefill worker): the handshake canary refuses the peer
// before any request moves KV; with the canary off, --kv-verify fails the request instead (sample
// catches it too: every unit is wrong, the shifted heads and the one left unwritten); with both
// off, the same fault gives a wrong answer, so the checks are what stands between it and the
// client.
class DisaggFault : public DisaggMatrix {
  protected:
    struct Run {
        Answer answer;
        Answer want;
        kv::KvConnectorStats decode, prefill;
    };
    Run RunWithFault(const std::string& tag, WorkerOptions o) {
        const Case c = GetParam();
        const bool push = c.mode == KvTransferMode::kPush;
        WorkerOptions faulty = o;
        faulty.fault_head_offset = 1;
        const std::vector<std::pair<std::string, std::vector<int32_t>>> prompts = {
            {"f", Prompt(45, 9)}};
        auto sp = Greedy(4);
        Run run;
        run.want = Colocated(prompts, sp, 1, wide_)["f"];
        Answers pa, da;  // before the engines: their step threads call into them until gone
        Worker prefill =
            MakeWorker("prefill-f" + tag, c.backend, wide_->Load(1), push ? faulty : o);
        Worker decode = MakeWorker("decode-f" + tag, c.backend, wide_->Load(1), push ? o : faulty);
        if (push) {
            FERRY_EXPECT_OK(Submit(decode.engine.get(), &da, "f", prompts[0].second, sp,
                                   PushDecodeParams("xf", prefill)));
            if (!o.canary) {
                FERRY_EXPECT_OK(Submit(prefill.engine.get(), &pa, "f", prompts[0].second, sp,
                                       PushPrefillParams("xf")));
            }
        } else {
            auto psp = sp;
            psp.max_tokens = 1;
            auto kvp = std::make_shared<KvTransferParams>();
            kvp->do_remote_decode = true;
            FERRY_EXPECT_OK(Submit(prefill.engine.get(), &pa, "f", prompts[0].second, psp, kvp));
            EXPECT_TRUE(pa.Wait({"f"}));
            if (pa.Get("f").kv) {
                FERRY_EXPECT_OK(
                    Submit(decode.engine.get(), &da, "f", prompts[0].second, sp, pa.Get("f").kv));
            }
        }
        EXPECT_TRUE(da.Wait({"f"}));
        run.answer = da.Get("f");
        // Whatever happened, the decoder's blocks go back.
        EXPECT_TRUE(WaitStats(decode.engine.get(), [](const auto& s) {
            return s.kv_blocks_used == 0 && s.kv_loading == 0;
        }));
        if (push && !o.canary) {
            EXPECT_TRUE(pa.Wait({"f"}));
        }
        run.decode = decode.conn->Stats();
        run.prefill = prefill.conn->Stats();
        return run;
    }
};

TEST_P(DisaggFault, TheCanaryRefusesTheMappingAtTheHandshake) {
    Run r = RunWithFault("c", {.verify = kv::KvVerifyMode::kOff});
    EXPECT_EQ(r.answer.finish, FinishReason::kError);
    EXPECT_TRUE(r.answer.tokens.empty());
    // The side with the fault read the peer's canary through it and names the first wrong row.
    EXPECT_THAT(r.answer.error.message(),
                ::testing::AllOf(::testing::HasSubstr("kv canary: layer 0 head 0 K token 0 "
                                                      "arrived wrong"),
                                 ::testing::HasSubstr("the transfer mapping")));
    EXPECT_EQ(r.decode.canary_failures + r.prefill.canary_failures, 1u);
    EXPECT_EQ(r.decode.succeeded, 0u);
}

TEST_P(DisaggFault, KvVerifyFailsTheRequestWhereTheCanaryIsOff) {
    for (auto mode : {kv::KvVerifyMode::kAll, kv::KvVerifyMode::kSample}) {
        SCOPED_TRACE(std::string(kv::KvVerifyModeName(mode)));
        Run r = RunWithFault(std::string(kv::KvVerifyModeName(mode)),
                             {.verify = mode, .canary = false});
        EXPECT_EQ(r.answer.finish, FinishReason::kError);
        EXPECT_TRUE(r.answer.tokens.empty());
        EXPECT_THAT(r.answer.error, StatusHas(Code::kDataLoss, "kv verify: the KV of request f"));
        EXPECT_THAT(r.answer.error.message(), ::testing::HasSubstr("differs"));
        EXPECT_EQ(r.decode.verify_mismatches, 1u);
        EXPECT_EQ(r.decode.failures["verify"], 1u);
        EXPECT_EQ(r.decode.succeeded, 0u);
    }
    // Unchecked, the fault is a wrong answer (the checks above are what catches it).
    Run r = RunWithFault("o", {.verify = kv::KvVerifyMode::kOff, .canary = false});
    EXPECT_EQ(r.answer.finish, FinishReason::kLength) << r.answer.error.ToString();
    EXPECT_NE(r.answer.logprobs, r.want.logprobs);
    EXPECT_EQ(r.decode.verified, 0u);
}
std::vector<Case> FaultCases() {
    return {{"shm", 1, KvTransferMode::kPull}, {"tcp", 1, KvTransferMode::kPush}};
}
INSTANTIATE_TEST_SUITE_P(Protocols, DisaggFault, ::testing::ValuesIn(FaultCases()), CaseName);

// A peer that lies in its hello about its TP: refused in the hello-ack, naming both sizes and
// why, and the worker goes on serving.
TEST_F(Disagg, AHelloWhoseTpDoesNotDivideTheHeadsIsRefusedNamingBoth) {
    Answers pa, da;  // before the engines: their step threads call into them until gone
    Worker decode = MakeWorker("decode-t", "tcp", wide_->Load(1));
    auto liar = testing::ValueOrDie(Agent::Create(testing::TestConfig("liar-t", "tcp")), "liar");
    FERRY_ASSERT_OK(liar->Connect(decode.agent->ListenAddress(), std::chrono::seconds(5)).status());
    const kv::KvCacheSpec& s = decode.engine->caches()[0]->spec();
    auto hello = [&](int tp, int ranks) {
        kv::msg::Hello h;
        h.compat.model = wide_->Load(1)->fingerprint();
        h.compat.layers = s.num_layers;
        h.compat.kv_heads = 4;
        h.compat.head_dim = s.head_dim;
        h.compat.dtype = std::string(kv::KvDtypeName(s.dtype));
        h.compat.block_tokens = 8;
        h.compat.tp = tp;
        for (int i = 0; i < ranks; ++i) h.ranks.push_back({uint64_t(i + 1), 64, 0});
        h.addr = liar->ListenAddress();
        return kv::msg::Encode(h);
    };
    auto ack_to = [&](const std::string& hello_text) -> kv::msg::Hello {
        FERRY_EXPECT_OK(liar->Notify(decode.agent->name(), hello_text));
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (std::chrono::steady_clock::now() < until) {
            for (Notification& n : liar->WaitNotifications(until)) {
                auto m = kv::msg::Decode(n.payload);
                if (m.ok() && std::holds_alternative<kv::msg::Hello>(*m)) {
                    return std::get<kv::msg::Hello>(*m);
                }
            }
        }
        ADD_FAILURE() << "no hello-ack";
        return {};
    };
    kv::msg::Hello ack = ack_to(hello(3, 3));
    EXPECT_TRUE(ack.ack);
    EXPECT_FALSE(ack.ok);
    EXPECT_THAT(ack.error, ::testing::HasSubstr(
                               "tp differs (this worker 1, the peer 3) and the peer's 3 "
                               "neither divides nor is a multiple of the model's 4 kv heads"));
    ack = ack_to(hello(2, 3));
    EXPECT_FALSE(ack.ok);
    EXPECT_THAT(ack.error, ::testing::HasSubstr("lists 3 ranks for tp 2"));
    // Still serving: a good peer's handshake and transfer work.
    auto prompt = Prompt(20, 1);
    auto want = Colocated({{"g", prompt}}, Greedy(3), 1, wide_);
    Worker prefill = MakeWorker("prefill-t", "tcp", wide_->Load(1));
    FERRY_ASSERT_OK(
        Submit(decode.engine.get(), &da, "g", prompt, Greedy(3), PushDecodeParams("xg", prefill)));
    FERRY_ASSERT_OK(
        Submit(prefill.engine.get(), &pa, "g", prompt, Greedy(3), PushPrefillParams("xg")));
    ASSERT_TRUE(da.Wait({"g"}));
    EXPECT_EQ(da.Get("g").tokens, want["g"].tokens) << da.Get("g").error.ToString();
    EXPECT_TRUE(pa.Wait({"g"}));
}

TEST_F(Disagg, AModelMismatchIsRefusedAtHandshakeNamingTheField) {
    Worker prefill = MakeWorker("prefill-m", "tcp", Model(1));
    Worker decode = MakeWorker("decode-m", "tcp", other_->Load(1));
    Answers pa, da;
    auto prompt = Prompt(30, 2);
    FERRY_ASSERT_OK(
        Submit(decode.engine.get(), &da, "m", prompt, Greedy(4), PushDecodeParams("m", prefill)));
    ASSERT_TRUE(da.Wait({"m"}));
    Answer a = da.Get("m");
    EXPECT_EQ(a.finish, FinishReason::kError);
    EXPECT_THAT(a.error,
                StatusHas(Code::kFailedPrecondition, "model (weights fingerprint) differs"));
    EXPECT_TRUE(a.tokens.empty());
    EXPECT_TRUE(
        WaitStats(decode.engine.get(), [](const auto& s) { return s.kv_blocks_used == 0; }));
}

TEST_F(Disagg, AnUnclaimedHoldIsFreedWhenItsLeaseLapsesAndALateReaderIsRefused) {
    Worker prefill =
        MakeWorker("prefill-l", "shm", Model(1), {.hold_lease = std::chrono::milliseconds(300)});
    Worker decode = MakeWorker("decode-l", "shm", Model(1));
    Answers pa, da;
    auto prompt = Prompt(50, 3);
    auto kvp = std::make_shared<KvTransferParams>();
    kvp->do_remote_decode = true;
    FERRY_ASSERT_OK(Submit(prefill.engine.get(), &pa, "l", prompt, Greedy(1), kvp));
    ASSERT_TRUE(pa.Wait({"l"}));
    EXPECT_EQ(prefill.engine->Stats().kv_held, 1);
    EXPECT_GT(prefill.engine->Stats().kv_blocks_used, 0);
    EXPECT_TRUE(WaitStats(prefill.engine.get(),
                          [](const auto& s) { return s.kv_held == 0 && s.kv_blocks_used == 0; }));
    EXPECT_EQ(prefill.conn->Stats().failures["lease_expired"], 1u);
    // A decoder that comes now is told the KV is gone, and produces no token.
    FERRY_ASSERT_OK(Submit(decode.engine.get(), &da, "l", prompt, Greedy(4), pa.Get("l").kv));
    ASSERT_TRUE(da.Wait({"l"}));
    EXPECT_EQ(da.Get("l").finish, FinishReason::kError);
    EXPECT_THAT(da.Get("l").error, StatusHas(Code::kUnavailable, "lease expired"));
    EXPECT_TRUE(da.Get("l").tokens.empty());
    EXPECT_TRUE(
        WaitStats(decode.engine.get(), [](const auto& s) { return s.kv_blocks_used == 0; }));
}

// A decoder renews the holds of requests waiting to claim them (its engine stalled here: it
// steps only when the test says, as a decoder wedged or busy for seconds would): the hold
// outlives its 0.5 s lease and the request equals colocated; without renewals it lapses. And a
// decoder that dies stops renewing: its hold comes back within three renewal intervals, not the
// prefill worker's whole lease.
TEST_F(Disagg, StalledDecodersRenewTheirHoldsAndADeadOnesHoldsComeBackSoon) {
    auto hold_for_reader = [] {
        auto kvp = std::make_shared<KvTransferParams>();
        kvp->do_remote_decode = true;
        return kvp;
    };
    // Steps the stalled engine until `id` is answered.
    auto drive = [](Worker& w, Answers& a, const std::string& id) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!a.Wait({id}, std::chrono::milliseconds(1)) &&
               std::chrono::steady_clock::now() < until) {
            w.engine->Step();
        }
        return a.Wait({id}, std::chrono::milliseconds(1));
    };
    const auto prompt = Prompt(60, 7);
    const auto want = Colocated({{"q", prompt}}, Greedy(4));
    for (int renew_ms : {100, 0}) {
        SCOPED_TRACE(renew_ms ? "renewed" : "not renewed");
        Worker prefill = MakeWorker("prefill-r" + std::to_string(renew_ms), "shm", Model(1),
                                    {.hold_lease = std::chrono::milliseconds(500)});
        Worker decode = MakeWorker(
            "decode-r" + std::to_string(renew_ms), "shm", Model(1),
            {.hold_renew_interval = std::chrono::milliseconds(renew_ms), .manual_steps = true});
        Answers pa, da;
        // A first request, so the peers have shaken hands (renewals go to ready peers).
        FERRY_ASSERT_OK(
            Submit(prefill.engine.get(), &pa, "w", Prompt(20, 2), Greedy(1), hold_for_reader()));
        ASSERT_TRUE(pa.Wait({"w"}));
        FERRY_ASSERT_OK(
            Submit(decode.engine.get(), &da, "w", Prompt(20, 2), Greedy(2), pa.Get("w").kv));
        ASSERT_TRUE(drive(decode, da, "w"));
        ASSERT_EQ(da.Get("w").finish, FinishReason::kLength);
        FERRY_ASSERT_OK(
            Submit(prefill.engine.get(), &pa, "q", prompt, Greedy(1), hold_for_reader()));
        ASSERT_TRUE(pa.Wait({"q"}));
        FERRY_ASSERT_OK(Submit(decode.engine.get(), &da, "q", prompt, Greedy(4), pa.Get("q").kv));
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // three leases
        ASSERT_TRUE(drive(decode, da, "q"));
        if (renew_ms) {
            EXPECT_EQ(da.Get("q").finish, FinishReason::kLength) << da.Get("q").error.ToString();
            EXPECT_EQ(da.Get("q").tokens, want.at("q").tokens);
            EXPECT_GE(prefill.conn->Stats().holds_renewed, 5u);
            EXPECT_EQ(prefill.conn->Stats().failures["lease_expired"], 0u);
            // Read, a hold is renewed no more while its request decodes on (a long one here,
            // stepped for 0.5 s: five renewal intervals).
            FERRY_ASSERT_OK(Submit(prefill.engine.get(), &pa, "z", Prompt(40, 9), Greedy(1),
                                   hold_for_reader()));
            ASSERT_TRUE(pa.Wait({"z"}));
            FERRY_ASSERT_OK(
                Submit(decode.engine.get(), &da, "z", Prompt(40, 9), Greedy(900), pa.Get("z").kv));
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
            while (prefill.engine->Stats().kv_held != 0 &&
                   std::chrono::steady_clock::now() < until) {
                decode.engine->Step();
            }
            ASSERT_EQ(prefill.engine->Stats().kv_held, 0);
            const uint64_t renewals = decode.conn->Stats().holds_renewals_sent;
            const auto more = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
            while (std::chrono::steady_clock::now() < more) {
                decode.engine->Step();
                std::this_thread::sleep_for(std::chrono::milliseconds(2));
            }
            EXPECT_FALSE(da.Wait({"z"}, std::chrono::milliseconds(1))) << "still decoding";
            EXPECT_EQ(decode.conn->Stats().holds_renewals_sent, renewals);
            EXPECT_EQ(prefill.conn->Stats().messages_refused, 0u);
            decode.engine->Abort("z");
            ASSERT_TRUE(drive(decode, da, "z"));
        } else {
            EXPECT_THAT(da.Get("q").error, StatusHas(Code::kUnavailable, "lease expired"));
            EXPECT_EQ(prefill.conn->Stats().failures["lease_expired"], 1u);
        }
    }
    // The decoder dies while its request waits: the 10 s hold comes back within ~0.3 s of the
    // last renewal.
    Worker prefill = MakeWorker("prefill-rd", "shm", Model(1));
    auto decode = std::make_unique<Worker>(
        MakeWorker("decode-rd", "shm", Model(1),
                   {.hold_renew_interval = std::chrono::milliseconds(100), .manual_steps = true}));
    Answers pa, da;
    FERRY_ASSERT_OK(
        Submit(prefill.engine.get(), &pa, "w", Prompt(20, 2), Greedy(1), hold_for_reader()));
    ASSERT_TRUE(pa.Wait({"w"}));
    FERRY_ASSERT_OK(
        Submit(decode->engine.get(), &da, "w", Prompt(20, 2), Greedy(2), pa.Get("w").kv));
    ASSERT_TRUE(drive(*decode, da, "w"));
    FERRY_ASSERT_OK(Submit(prefill.engine.get(), &pa, "q", prompt, Greedy(1), hold_for_reader()));
    ASSERT_TRUE(pa.Wait({"q"}));
    FERRY_ASSERT_OK(Submit(decode->engine.get(), &da, "q", prompt, Greedy(4), pa.Get("q").kv));
    ASSERT_TRUE(testing::WaitUntil([&] { return prefill.conn->Stats().holds_renewed >= 2; }));
    const auto died = std::chrono::steady_clock::now();
    decode.reset();
    EXPECT_TRUE(WaitStats(prefill.engine.get(), [](const auto& s) { return s.kv_held == 0; }));
    EXPECT_LT(std::chrono::steady_clock::now() - died, std::chrono::seconds(5));
    EXPECT_EQ(prefill.conn->Stats().failures["lease_expired"], 1u);
}

// push: a prefill worker whose request is queued (not yet scheduled) or bound to a decoder's
// blocks but not run yet (its engine stalled here: it steps only when the test says, as a
// worker busy or wedged for seconds would) tells the decoder to go on waiting (push-alive): the
// decoder's 0.6 s wait is outlived and the answer equals colocated. Without push-alive the
// decoder gives up at its deadline.
TEST_F(Disagg, APushDecoderWaitsAsLongAsItsPrefillWorkerSaysItIsAlive) {
    const auto prompt = Prompt(60, 8);
    const auto want = Colocated({{"q", prompt}}, Greedy(4));
    for (auto [renew_ms, scheduled] : {std::pair{100, true}, {100, false}, {0, true}}) {
        SCOPED_TRACE(renew_ms ? "renewed" : "not renewed");
        SCOPED_TRACE(scheduled ? "bound to its target" : "queued");
        const std::string tag = fmt::format("{}{}", renew_ms, scheduled ? "b" : "q");
        Worker prefill = MakeWorker(
            "prefill-pa" + tag, "shm", Model(1),
            {.hold_renew_interval = std::chrono::milliseconds(renew_ms), .manual_steps = true});
        Worker decode = MakeWorker("decode-pa" + tag, "shm", Model(1),
                                   {.transfer_timeout = std::chrono::milliseconds(300),
                                    .bootstrap_timeout = std::chrono::milliseconds(300)});
        Answers pa, da;
        const std::string xid = "push-alive-" + tag;
        // The prefill request first: scheduled once (parked until its decoder's blocks come,
        // which binds them to it), or not at all (queued: the blocks wait as an early target).
        FERRY_ASSERT_OK(
            Submit(prefill.engine.get(), &pa, "q", prompt, Greedy(1), PushPrefillParams(xid)));
        if (scheduled) {
            ASSERT_TRUE(testing::WaitUntil([&] {
                prefill.engine->Step();
                return prefill.conn->Stats().bootstrapping == 1;
            }));
        }
        FERRY_ASSERT_OK(Submit(decode.engine.get(), &da, "q", prompt, Greedy(4),
                               PushDecodeParams(xid, prefill)));
        // The decoder waits for the writes, the prefill engine does not step.
        ASSERT_TRUE(
            testing::WaitUntil([&] { return decode.conn->Stats().waiting_for_input == 1; }));
        if (scheduled) {
            ASSERT_TRUE(
                testing::WaitUntil([&] { return prefill.conn->Stats().bootstrapping == 0; }));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // 2.5 whole waits
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (!pa.Wait({"q"}, std::chrono::milliseconds(1)) &&
               std::chrono::steady_clock::now() < until) {
            prefill.engine->Step();
        }
        ASSERT_TRUE(da.Wait({"q"}));
        if (renew_ms) {
            EXPECT_EQ(da.Get("q").finish, FinishReason::kLength) << da.Get("q").error.ToString();
            EXPECT_EQ(da.Get("q").tokens, want.at("q").tokens);
            EXPECT_GE(prefill.conn->Stats().push_renewals_sent, 10u);
            EXPECT_GE(decode.conn->Stats().pushes_renewed, 10u);
        } else {
            EXPECT_EQ(da.Get("q").finish, FinishReason::kError);
            EXPECT_THAT(da.Get("q").error, StatusHas(Code::kDeadlineExceeded, "in time"));
            EXPECT_EQ(decode.conn->Stats().pushes_renewed, 0u);
        }
        EXPECT_TRUE(WaitStats(decode.engine.get(), [](const auto& s) {
            return s.kv_blocks_used == 0 && s.kv_loading == 0;
        }));
        const auto drained = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (prefill.engine->Stats().kv_blocks_used != 0 &&
               std::chrono::steady_clock::now() < drained) {
            prefill.engine->Step();
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        EXPECT_EQ(prefill.engine->Stats().kv_blocks_used, 0);
    }
}

TEST_F(Disagg, APrefillWorkerThatDiesWhileADecoderWaitsFailsTheRequestWithinSeconds) {
    Worker decode = MakeWorker("decode-d", "tcp", Model(1));
    Answers pa, da;
    auto prompt = Prompt(80, 5);
    auto start = std::chrono::steady_clock::now();
    {
        Worker prefill = MakeWorker("prefill-d", "tcp", Model(1));
        // The prefill request never comes: the decoder waits for input, holding its blocks.
        FERRY_ASSERT_OK(Submit(decode.engine.get(), &da, "d", prompt, Greedy(4),
                               PushDecodeParams("d", prefill)));
        ASSERT_TRUE(
            WaitStats(decode.engine.get(), [](const auto& s) { return s.kv_loading == 1; }));
        ASSERT_TRUE(
            testing::WaitUntil([&] { return decode.conn->Stats().waiting_for_input == 1; }));
        start = std::chrono::steady_clock::now();
    }  // the prefill worker goes: engine, connector, agent
    ASSERT_TRUE(da.Wait({"d"}, std::chrono::seconds(10)));
    auto took = std::chrono::steady_clock::now() - start;
    Answer a = da.Get("d");
    EXPECT_EQ(a.finish, FinishReason::kError);
    EXPECT_THAT(a.error, StatusHas(Code::kUnavailable, "prefill-d"));
    EXPECT_TRUE(a.tokens.empty());
    EXPECT_LT(took, std::chrono::seconds(5));  // bounded by the liveness probe, not a timeout
    EXPECT_TRUE(WaitStats(decode.engine.get(), [](const auto& s) {
        return s.kv_blocks_used == 0 && s.kv_loading == 0;
    }));
}

TEST_F(Disagg, AClientThatLeavesAPushDecoderFreesItsBlocksOnceThePrefillStops) {
    Worker prefill = MakeWorker("prefill-a", "shm", Model(1));
    Worker decode = MakeWorker("decode-a", "shm", Model(1));
    Answers pa, da;
    auto prompt = Prompt(120, 6);
    FERRY_ASSERT_OK(
        Submit(decode.engine.get(), &da, "a", prompt, Greedy(4), PushDecodeParams("a", prefill)));
    ASSERT_TRUE(testing::WaitUntil([&] { return decode.conn->Stats().waiting_for_input == 1; }));
    decode.engine->Abort("a");
    ASSERT_TRUE(da.Wait({"a"}));
    EXPECT_EQ(da.Get("a").finish, FinishReason::kAbort);
    EXPECT_TRUE(WaitStats(decode.engine.get(),
                          [](const auto& s) { return s.kv_blocks_used == 0 && s.kv_held == 0; }));
    // The prefill request that comes later finds its decoder gone and frees its blocks too.
    FERRY_ASSERT_OK(
        Submit(prefill.engine.get(), &pa, "a", prompt, Greedy(1), PushPrefillParams("a")));
    ASSERT_TRUE(pa.Wait({"a"}, std::chrono::seconds(60)));
    EXPECT_TRUE(WaitStats(prefill.engine.get(), [](const auto& s) {
        return s.kv_blocks_used == 0 && s.kv_held == 0 && s.kv_parked == 0;
    }));
}

TEST_F(Disagg, ParamsWithoutAConnectorAreRefused) {
    engine::EngineConfig ec;
    ec.block_tokens = 8;
    ec.num_blocks = 64;
    auto e = testing::ValueOrDie(Engine::Create(Model(1), ec));
    Answers a;
    auto kvp = std::make_shared<KvTransferParams>();
    kvp->do_remote_decode = true;
    EXPECT_THAT(Submit(e.get(), &a, "x", Prompt(5, 1), Greedy(1), kvp),
                StatusHas(Code::kInvalidArgument, "no KV connector"));
}

// A connector kind added by name, as an encoder-cache or speculative-decoding connector would be:
// the worker assembly creates it from the registry and the engine runs it, neither changed.
TEST_F(Disagg, AConnectorKindRegisteredByNameIsTheOneAWorkerRuns) {
    static std::atomic<int> created{0};
    kv::KvConnectorKind base = testing::ValueOrDie(kv::FindKvConnector("ferry"));
    kv::KvConnectorKind k = base;
    k.name = "ferry-counted";
    k.create = [base](const kv::KvConnectorContext& c) {
        ++created;
        return base.create(c);
    };
    if (kv::FindKvConnector(k.name).status().code() == Code::kNotFound) {
        FERRY_ASSERT_OK(kv::RegisterKvConnector(k));
    }
    const int before = created.load();
    serve::WorkerConfig c;
    c.role = serve::WorkerRole::kDecode;
    c.model = Model(1);
    c.agent = testing::TestConfig("decode-kind", "shm");
    c.kv_connector = "ferry-counted";
    c.engine.block_tokens = 8;
    c.engine.num_blocks = 64;
    c.serve_http = false;
    auto w = testing::ValueOrDie(serve::Worker::Start(c), "worker");
    EXPECT_EQ(created.load(), before + 1);
    ASSERT_NE(std::dynamic_pointer_cast<kv::AgentKvConnector>(w->connector()), nullptr);
    // Its params are the connector's to parse.
    auto p = w->connector()->ParseParams(nlohmann::json::parse(R"({"do_remote_decode":true})"));
    ASSERT_TRUE(p.ok() && *p) << p.status().ToString();
    EXPECT_TRUE((*p)->prefill_only());
    // An unknown kind stops the worker before anything starts.
    c.kv_connector = "no-such-kind";
    c.agent.name = "decode-kind-2";
    EXPECT_THAT(serve::Worker::Start(c), StatusHas(Code::kNotFound, "no-such-kind"));
}

}  // namespace
}  // namespace ferry
