// The byte-level tokenizer of ferry's random-weight models, built once per fuzzer process.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "gguf/gguf.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

inline const ferry::tokenizer::Tokenizer& TestTokenizer() {
    static std::unique_ptr<ferry::tokenizer::Tokenizer> tk = [] {
        std::string path = "/tmp/ferry-fuzz-tok-" + std::to_string(getpid()) + ".gguf";
        ferry::model::RandomModelSpec s;
        s.dim = 16;
        s.num_layers = 1;
        s.num_heads = 1;
        s.num_kv_heads = 1;
        s.ffn_dim = 16;
        if (!ferry::model::WriteRandomModel(s, 1, path).ok()) std::abort();
        auto file = std::move(ferry::gguf::GgufFile::Open(path)).value();
        auto t = std::move(ferry::tokenizer::Tokenizer::FromGguf(*file)).value();
        unlink(path.c_str());
        return t;
    }();
    return *tk;
}
