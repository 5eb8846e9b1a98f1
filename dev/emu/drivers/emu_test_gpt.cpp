/*
 * emu_test_gpt.cpp: test_gpt (the CUDA trainer against the CPU reference)
 * built for remat's CPU emulator of CUDA (dev/emu). NOT a GPU: a pass here
 * says the kernels' logic matches the CPU reference under emulation; it is
 * never GPU verification (dev/emu/README.md).
 *
 * Why it exists: test_gpt.cu's own main runs shapes sized for a GPU (C=256,
 * T=1024), hours under emulation. This driver includes the transformed
 * test_gpt.cu whole (its main renamed) and runs either chosen cases with
 * test_gpt's own functions (run_case; check_nonfinite, the injected inf/NaN
 * and FP16 overflow checks; check_attention, the attention kernels alone with
 * a sharp softmax), or, with --full, test_gpt's main unchanged.
 *
 * usage: emu_test_gpt_PREC CASE...      CASE = NAME:C:NH:V:T[,T...]            run_case  e.g. hs16:64:4:300:77,5
 *                                              nonfinite:NAME:C:NH:V:T[,T...]  check_nonfinite
 *                                              attention:NAME:C:NH:V:T[,T...]  check_attention
 *                                              dropout:NAME:C:NH:V:T[,T...]    check_attention with attention dropout 0.1
 *                                              long:NAME:C:NH:V:T[,T...]       check_attention at B=1, T up to 4096
 *                                              longdrop:NAME:C:NH:V:T[,T...]   the same with attention dropout 0.1
 *                                              dropmodel:NAME:C:NH:V:T[,T...]  run_case with model_dropout()
 *                                              blocks:NAME:C:NH:V:Tc[,Tc...]   check_attention_tiles (chunks of Tc rows)
 *                                              blocksdrop:NAME:C:NH:V:Tc[,...] the same with attention dropout 0.1
 *                                              docs:NAME:C:NH:V:T[,T...]       check_documents (packed documents)
 *                                              docsdrop:NAME:C:NH:V:T[,T...]   the same with attention dropout 0.1
 *                                              gqa:NAME:NH:NKV:HD:T[,T...]     check_attention_gqa (grouped-query heads)
 *                                              gqadrop:NAME:NH:NKV:HD:T[,...]  the same with documents and attention dropout 0.1
 *                                              gqaring2:NAME:NH:NKV:HD:Tc[,..] check_attention_ring_gqa, 2 members, dropout 0.1
 *                                              gqaring3:NAME:NH:NKV:HD:Tc[,..] the same, 3 members, with documents
 *                                              accum:NAME:C:NH:V:T[,T...]      check_grad_accumulation
 *                                              tilebound:NAME:C:NH:V:T[,T...]  check_tiles_vs_untiled (needs tilesK:)
 *                                              segments:NAME:C:NH:V:T[,T...]   check_segments (--segment-layers against -r 0, dropout)
 *        a tilesK: prefix (K rows per token tile) runs the GPU side of run_case, dropmodel: and
 *        tilebound: with --tile-tokens K, e.g. tiles7:dropmodel:hs16:64:4:300:77
 *        emu_test_gpt_PREC presence      check_gpu_presence (when "no GPU" is a skip)
 *        emu_test_gpt_PREC bias          check_bias_fallback (a misaligned bias takes the bias kernel)
 *        emu_test_gpt_PREC kernels       check_memory_kernels (the memory-bound kernels' vector and scalar paths)
 *        emu_test_gpt_PREC wide          check_wide_offsets (row-wise kernels on rows past element 2^31: the last blocks alone)
 *        emu_test_gpt_PREC --full        test_gpt's own main (every shape; slow)
 *        emu_test_gpt_PREC --quick       test_gpt's own main with --quick (what dev/gpu_check.sh's sanitizers ran before)
 *        emu_test_gpt_PREC --sanitize    test_gpt's own main with --sanitize (what they run: the default attention too)
 * Exit status: 0 all passed, 1 a check failed, 2 bad usage; the emulator
 * aborts (SIGABRT) on undefined behaviour it detects, with a message.
 */
#define main test_gpt_main
#include "test_gpt.cu"
#undef main

#include <string>
#include <vector>

static void banner(void) {
    printf("emu: test_gpt (%s) under the CPU emulator of CUDA (dev/emu) - NOT a GPU; results are not GPU verification\n", PRECISION_NAME);
    fflush(stdout);
}

static int usage(void) {
    fprintf(stderr, "usage: emu_test_gpt CASE...   (CASE = [tilesK:][nonfinite:|attention:|dropout:|long:|longdrop:|dropmodel:|accum:|tilebound:|segments:|blocks:|blocksdrop:|docs:|docsdrop:]NAME:C:NH:V:T[,T...], e.g. hs16:64:4:300:77,5;\n"
                    "       or gqa:|gqadrop:|gqaring2:|gqaring3:NAME:NH:NKV:HD:T[,T...], e.g. gqa:g3:6:2:64:77)\n"
                    "       emu_test_gpt presence  (when \"no GPU\" is a skip and when a failure)\n"
                    "       emu_test_gpt bias      (a misaligned bias takes matmul.cuh's bias kernel)\n"
                    "       emu_test_gpt kernels   (the memory-bound kernels alone: vector and scalar paths)\n"
                    "       emu_test_gpt wide      (row-wise kernels on rows past element 2^31: their grids' last blocks)\n"
                    "       emu_test_gpt --full    (test_gpt's own main: every shape, slow)\n"
                    "       emu_test_gpt --quick|--sanitize   (test_gpt's own main with that flag: dev/gpu_check.sh's sanitizer cases)\n");
    return 2;
}

int main(int argc, char** argv) {
    if (argc == 2 && (strcmp(argv[1], "--full") == 0 || strcmp(argv[1], "--quick") == 0 || strcmp(argv[1], "--sanitize") == 0)) {
        banner();
        int full = strcmp(argv[1], "--full") == 0;
        char* own_argv[] = {argv[0], full ? NULL : argv[1], NULL};
        int rc = test_gpt_main(full ? 1 : 2, own_argv);
        printf("emu: test_gpt's own main returned %d (emulated, not GPU verification)\n", rc);
        return rc;
    }
    if (argc == 2 && (strcmp(argv[1], "presence") == 0 || strcmp(argv[1], "bias") == 0 || strcmp(argv[1], "kernels") == 0 ||
                      strcmp(argv[1], "wide") == 0)) {
        banner();
        if (argv[1][0] == 'p') check_gpu_presence();
        else if (argv[1][0] == 'b') check_bias_fallback();
        else if (argv[1][0] == 'w') check_wide_offsets();
        else check_memory_kernels();
        return g_failures ? 1 : 0;
    }
    if (argc < 2) return usage();
    enum Kind { RUN_CASE, NONFINITE, ATTENTION, ATTENTION_DROPOUT, LONG, LONG_DROPOUT, MODEL_DROPOUT, ACCUM, TILE_BOUND, SEGMENTS, BLOCKS, BLOCKS_DROPOUT,
                DOCUMENTS, DOCUMENTS_DROPOUT, GQA, GQA_DROPOUT, GQA_RING2, GQA_RING3 };
    struct Case { Kind kind; std::string name; int C, NH, V, tiles; std::vector<int> Ts; };
    std::vector<Case> cases;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        Kind kind = RUN_CASE;
        int tiles = 0;
        if (a.rfind("tiles", 0) == 0 && a.size() > 5 && isdigit((unsigned char)a[5])) {
            size_t colon = a.find(':');
            tiles = atoi(a.substr(5, colon - 5).c_str());
            if (colon == std::string::npos || tiles <= 0) return usage();
            a = a.substr(colon + 1);
        }
        if (a.rfind("tilebound:", 0) == 0) {
            kind = TILE_BOUND;
            a = a.substr(10);
            if (!tiles) return usage();
        } else if (a.rfind("nonfinite:", 0) == 0) {
            kind = NONFINITE;
            a = a.substr(10);
        } else if (a.rfind("attention:", 0) == 0) {
            kind = ATTENTION;
            a = a.substr(10);
        } else if (a.rfind("dropout:", 0) == 0) {
            kind = ATTENTION_DROPOUT;
            a = a.substr(8);
        } else if (a.rfind("long:", 0) == 0) {
            kind = LONG;
            a = a.substr(5);
        } else if (a.rfind("longdrop:", 0) == 0) {
            kind = LONG_DROPOUT;
            a = a.substr(9);
        } else if (a.rfind("dropmodel:", 0) == 0) {
            kind = MODEL_DROPOUT;
            a = a.substr(10);
        } else if (a.rfind("segments:", 0) == 0) {
            kind = SEGMENTS;
            a = a.substr(9);
        } else if (a.rfind("accum:", 0) == 0) {
            kind = ACCUM;
            a = a.substr(6);
        } else if (a.rfind("blocks:", 0) == 0) {
            kind = BLOCKS;
            a = a.substr(7);
        } else if (a.rfind("blocksdrop:", 0) == 0) {
            kind = BLOCKS_DROPOUT;
            a = a.substr(11);
        } else if (a.rfind("docs:", 0) == 0) {
            kind = DOCUMENTS;
            a = a.substr(5);
        } else if (a.rfind("docsdrop:", 0) == 0) {
            kind = DOCUMENTS_DROPOUT;
            a = a.substr(9);
        } else if (a.rfind("gqa:", 0) == 0) {
            kind = GQA;
            a = a.substr(4);
        } else if (a.rfind("gqadrop:", 0) == 0) {
            kind = GQA_DROPOUT;
            a = a.substr(8);
        } else if (a.rfind("gqaring2:", 0) == 0 || a.rfind("gqaring3:", 0) == 0) {
            kind = a[7] == '2' ? GQA_RING2 : GQA_RING3;
            a = a.substr(9);
        }
        std::vector<std::string> f;
        size_t p = 0, q;
        while ((q = a.find(':', p)) != std::string::npos) { f.push_back(a.substr(p, q - p)); p = q + 1; }
        f.push_back(a.substr(p));
        if (f.size() != 5) return usage();
        Case c;
        c.kind = kind;
        c.tiles = tiles;
        c.name = f[0];
        c.C = atoi(f[1].c_str());
        c.NH = atoi(f[2].c_str());
        c.V = atoi(f[3].c_str());
        p = 0;
        std::string ts = f[4];
        while (true) {
            q = ts.find(',', p);
            c.Ts.push_back(atoi(ts.substr(p, q == std::string::npos ? std::string::npos : q - p).c_str()));
            if (q == std::string::npos) break;
            p = q + 1;
        }
        const bool gqa = kind == GQA || kind == GQA_DROPOUT || kind == GQA_RING2 || kind == GQA_RING3; /* C, NH, V: NH, NKV, HD */
        if (c.C <= 0 || c.NH <= 0 || c.V <= 0 || c.C % c.NH || (gqa && c.V > 128)) return usage();
        const int max_T = kind == LONG || kind == LONG_DROPOUT ? 4096 : 1024; /* one sequence at B=1: many tiles */
        for (int T : c.Ts)
            if (T <= 0 || T > max_T) return usage();
        cases.push_back(c);
    }
    banner();
    int runs = 0;
    for (const Case& c : cases) {
        Shape sh = {c.name.c_str(), c.C, c.NH, c.V};
        g_tile_tokens = c.kind == TILE_BOUND ? 0 : c.tiles;
        for (int T : c.Ts) {
            if (c.kind == TILE_BOUND) check_tiles_vs_untiled(&sh, T, c.tiles, &dropout_off);
            else if (c.kind == NONFINITE) check_nonfinite(&sh, T);
            else if (c.kind == ATTENTION) check_attention(&sh, TEST_B, T, 0);
            else if (c.kind == ATTENTION_DROPOUT) check_attention(&sh, TEST_B, T, 0.1f);
            else if (c.kind == LONG) check_attention(&sh, 1, T, 0);
            else if (c.kind == LONG_DROPOUT) check_attention(&sh, 1, T, 0.1f);
            else if (c.kind == ACCUM) check_grad_accumulation(&sh, T);
            else if (c.kind == BLOCKS) check_attention_tiles(&sh, TEST_B, T, 0);
            else if (c.kind == BLOCKS_DROPOUT) check_attention_tiles(&sh, TEST_B, T, 0.1f);
            else if (c.kind == DOCUMENTS) check_documents(&sh, TEST_B, T, 0);
            else if (c.kind == DOCUMENTS_DROPOUT) check_documents(&sh, TEST_B, T, 0.1f);
            else if (c.kind == GQA || c.kind == GQA_DROPOUT || c.kind == GQA_RING2 || c.kind == GQA_RING3) {
                const GqaShape g = {c.name.c_str(), c.C, c.NH, c.V};
                if (c.kind == GQA) check_attention_gqa(&g, TEST_B, T, 0, 0);
                else if (c.kind == GQA_DROPOUT) check_attention_gqa(&g, TEST_B, T, 0.1f, 1);
                else check_attention_ring_gqa(&g, c.kind == GQA_RING2 ? 2 : 3, TEST_B, T, 0.1f, c.kind == GQA_RING3);
            }
            else if (c.kind == SEGMENTS) {
                const DropoutState drop = model_dropout();
                check_segments(&sh, T, &drop);
            } else if (c.kind == MODEL_DROPOUT) {
                const DropoutState drop = model_dropout();
                run_case(&sh, T, &drop);
            } else run_case(&sh, T, &dropout_off);
            runs++;
        }
    }
    if (g_failures) {
        printf("\nFAIL (emulated): test_gpt (%s): %d check%s failed in %d case%s\n", PRECISION_NAME, g_failures, g_failures == 1 ? "" : "s",
               runs, runs == 1 ? "" : "s");
        return 1;
    }
    printf("\nPASS (emulated, not GPU verification): test_gpt (%s): every check passed in %d case%s\n", PRECISION_NAME, runs,
           runs == 1 ? "" : "s");
    return 0;
}
