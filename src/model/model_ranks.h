// Model's private parts, shared by its loading (model_load.cc) and its forward pass (model.cc):
// a TP rank's weights and workspace, and the pool of threads that runs the ranks.
#pragma once

#include <barrier>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "model/kernels.h"
#include "model/model.h"

namespace ferry::model {

// Weights in the file's precision (kernels.h).
struct Model::Layer {
    Weights wqkv;   // [(q + 2 kv) * head_dim][dim]; MLA: the queries' rows (or q_a's), then kv_a's
    Weights wo;     // [dim][q * head_dim]; MLA: [dim][q * v_head_dim]
    Weights wgu;    // [2 ffn][dim]: gate rows, then up rows
    Weights wdown;  // [dim][ffn]
    // MLA only.
    Weights wqb;                   // [q * (nope + rope)][q_lora_rank] (with a query LoRA)
    std::vector<float> q_a_norm;   // [q_lora_rank]
    std::vector<float> kv_a_norm;  // [kv_lora_rank]
    std::vector<float> wkb;        // [q heads][kv_lora_rank][nope]: no-RoPE query to latent
    std::vector<float> wvb;        // [q heads][v_head_dim][kv_lora_rank]: latent to value
};

struct Model::AttendSpace {
    AlignedFloats kbuf, vbuf, qstack, scores;
};

struct Model::Rank {
    int q_heads = 0, kv_heads = 0, ffn = 0;
    int vocab_begin = 0, vocab_end = 0;
    std::vector<Layer> layers;
    std::vector<float> attn_norm, ffn_norm;  // [layers][dim], shared values
    Weights wout;                            // [vocab_end - vocab_begin][dim]
    // The threads of this rank's matrix products on 16-bit weights.
    std::unique_ptr<WorkPool> work;
    // Workspace, grown as needed.
    // Cache-line aligned: the row kernels read rows of these with 64-byte loads.
    AlignedFloats xn, qkv, attn, partial, gu, act, sel, widened;
    AlignedFloats qa, qmla, qcat, olat;  // MLA: q LoRA, queries, latent-space queries, outputs
    // A layer's attention of short chunks: one part per chunk and KV head.
    struct ShortPart {
        const SeqChunk* chunk;
        int head, t0;
    };
    std::vector<ShortPart> short_parts;
    std::vector<ShortPart> long_parts;  // the same for long chunks (prefill)
    AttendSpace attend;  // the workspace of long chunks' attention, one head at a time

    // The forward pass's rows in runs of one kind: [begin, end) rows of short chunks (decode
    // steps), which go through the row kernels however many there are, or of long ones
    // (prefill), which go through sgemm. A sequence's numbers then depend on its own chunk,
    // not on what else is in the batch: a decode worker's tokens equal a colocated engine's
    // whatever each batched them with.
    struct RowRun {
        int begin, end;
        bool short_rows;
    };
    std::vector<RowRun> runs;

    // C = A W^T over the forward pass's rows, run by run.
    void MatMul(const float* a, int lda, const Weights& w, float* c, int ldc) {
        for (const RowRun& r : runs) {
            const float* ar = a + static_cast<size_t>(r.begin) * lda;
            float* cr = c + static_cast<size_t>(r.begin) * ldc;
            if (r.short_rows) {
                MatMulRows(r.end - r.begin, ar, lda, w, cr, ldc, *work);
            } else {
                MatMulBulk(r.end - r.begin, ar, lda, w, cr, ldc, *work, &widened);
            }
        }
    }
};

class Model::RankPool {
  public:
    explicit RankPool(int n) : n_(n), barrier_(n) {
        for (int r = 1; r < n; ++r) threads_.emplace_back([this, r] { Loop(r); });
    }
    ~RankPool() {
        {
            std::lock_guard lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }
    // Runs fn(r) for every rank, rank 0 on the caller, and returns when all are done.
    void Run(const std::function<void(int)>& fn) {
        if (n_ == 1) {
            fn(0);
            return;
        }
        {
            std::lock_guard lock(mu_);
            fn_ = &fn;
            pending_ = n_ - 1;
            ++generation_;
        }
        cv_.notify_all();
        fn(0);
        std::unique_lock lock(mu_);
        done_cv_.wait(lock, [&] { return pending_ == 0; });
        fn_ = nullptr;
    }
    void Sync() {
        if (n_ > 1) barrier_.arrive_and_wait();
    }

  private:
    void Loop(int r) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)>* fn;
            {
                std::unique_lock lock(mu_);
                cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
                if (stop_) return;
                seen = generation_;
                fn = fn_;
            }
            (*fn)(r);
            {
                std::lock_guard lock(mu_);
                if (--pending_ == 0) done_cv_.notify_one();
            }
        }
    }

    int n_;
    std::barrier<> barrier_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int)>* fn_ = nullptr;
    uint64_t generation_ = 0;
    int pending_ = 0;
    bool stop_ = false;
    std::vector<std::thread> threads_;
};

}  // namespace ferry::model
